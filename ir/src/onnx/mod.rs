//! ONNX import and export through in-tree protobuf messages.

mod export;
mod import;
mod legacy;
pub mod proto;

pub use export::{encode_onnx, encode_onnx_parts, export_opset};
pub use import::{decode_onnx, decode_subgraph, decode_tensor, read_onnx};
