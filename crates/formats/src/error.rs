use std::path::PathBuf;

/// A problem with a file on disk, always naming the file.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
}

impl FormatError {
    pub fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> FormatError {
        FormatError::Invalid { path: path.into(), msg: msg.into() }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> FormatError {
        FormatError::Io { path: path.into(), source }
    }

    /// Shows the path relative to nothing: "file: message".
    pub fn display_path(&self) -> String {
        match self {
            FormatError::Io { path, .. } | FormatError::Invalid { path, .. } => path.display().to_string(),
        }
    }
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
