//! ONNX import and export through in-tree protobuf messages.

mod export;
mod import;
mod legacy;
pub mod proto;
pub mod schema;
mod sequences;
pub mod torch_export;

pub use export::{encode_onnx, export_opset, write_onnx};
pub use import::{captures, check_subgraphs, decode_onnx, decode_subgraph, decode_tensor, read_onnx};
