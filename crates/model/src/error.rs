use sluice_formats::FormatError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A checkpoint that parses but does not describe a model we can run.
    #[error("{0}")]
    Invalid(String),
    /// Expert weights could not be made resident (read error, checksum, ...).
    #[error("expert fetch failed: {0}")]
    Expert(String),
    #[error("{0}")]
    Input(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
