use sluice_formats::FormatError;
use sluice_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{0}")]
    Input(String),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
