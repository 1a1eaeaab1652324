//! Errors of the IR layer. Messages name the node, value or line at fault; the CLI adds the file.

use crate::graph::GraphError;

#[derive(Debug, thiserror::Error)]
pub enum IrError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a valid ONNX model: {0}")]
    Decode(String),
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// A well-formed file describing an invalid model.
    #[error("{0}")]
    Invalid(String),
    #[error("line {line}: {msg}")]
    Parse { line: usize, msg: String },
}

pub type Result<T, E = IrError> = std::result::Result<T, E>;

pub(crate) fn invalid(msg: impl Into<String>) -> IrError {
    IrError::Invalid(msg.into())
}
