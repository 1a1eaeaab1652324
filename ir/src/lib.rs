//! mpc-ir: the graph, ops, dtypes, shapes and tensors of mpc, with ONNX import/export and the text IR.
//!
//! Passes and the runtime both depend on this crate; it depends on neither.

pub mod attr;
mod binary;
pub mod classify;
mod dtype;
mod error;
pub mod geometry;
pub mod graph;
pub mod onnx;
pub mod ops;
pub mod real;
mod shape;
pub mod symbolic;
mod tensor;
pub mod text;
pub mod train;
mod unary;

pub use attr::{Attr, Attrs};
pub use classify::{Class, Kind};
pub use dtype::DType;
pub use error::{IrError, Result};
pub use graph::{Def, Graph, GraphError, ModelMeta, Node, NodeId, TypeInfo, Use, Value, ValueId};
pub use ops::{Op, Opaque};
pub use shape::{normalize_axis, Dim, Shape};
pub use symbolic::SymExpr;
pub use tensor::{bf16_from_f64, f16_from_f64, ConvertAhead, Narrowing, Tensor};
pub use train::TrainSignature;
