//! ONNX protobuf messages, declared in-tree (field numbers from onnx.proto, proto2 syntax).
//!
//! No protoc and no generated code: the derive macros are the whole schema. Messages mpc never
//! looks inside (model-local functions, training info) are declared as `bytes`: an embedded
//! message has the same wire format, so they pass through untouched. Tensor data and raw
//! attributes are `Bytes`, so decoding from a `Bytes` buffer shares it instead of copying.
//!
//! Scalars that onnx.proto marks `[packed = true]` are packed here; other repeated scalars are
//! not, as proto2 requires. Readers accept both either way.

#![allow(clippy::derive_partial_eq_without_eq)]

use bytes::Bytes;

/// A model message with its graph field as `$graph` (decoded, or left encoded).
macro_rules! model_message {
    ($(#[$doc:meta])* $name:ident, $graph:ty, $graph_field:meta) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct $name {
            #[prost(int64, tag = "1")]
            pub ir_version: i64,
            #[prost(message, repeated, tag = "8")]
            pub opset_import: Vec<OperatorSetIdProto>,
            #[prost(string, tag = "2")]
            pub producer_name: String,
            #[prost(string, tag = "3")]
            pub producer_version: String,
            #[prost(string, tag = "4")]
            pub domain: String,
            #[prost(int64, tag = "5")]
            pub model_version: i64,
            #[prost(string, tag = "6")]
            pub doc_string: String,
            #[$graph_field]
            pub graph: Option<$graph>,
            #[prost(message, repeated, tag = "14")]
            pub metadata_props: Vec<StringStringEntryProto>,
            /// `FunctionProto`s, kept encoded.
            #[prost(bytes = "bytes", repeated, tag = "25")]
            pub functions: Vec<Bytes>,
        }
    };
}

model_message!(ModelProto, GraphProto, prost(message, optional, tag = "7"));
model_message!(
    /// A [`ModelProto`] with its graph left encoded, for the importer (see [`LazyGraphProto`]).
    LazyModelProto,
    Bytes,
    prost(bytes = "bytes", optional, tag = "7")
);

/// A graph message with its nodes as `$node` (decoded, or each left encoded).
macro_rules! graph_message {
    ($(#[$doc:meta])* $name:ident, $node:ty, $node_field:meta) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct $name {
            #[$node_field]
            pub node: Vec<$node>,
            #[prost(string, tag = "2")]
            pub name: String,
            #[prost(message, repeated, tag = "5")]
            pub initializer: Vec<TensorProto>,
            #[prost(message, repeated, tag = "15")]
            pub sparse_initializer: Vec<SparseTensorProto>,
            #[prost(string, tag = "10")]
            pub doc_string: String,
            #[prost(message, repeated, tag = "11")]
            pub input: Vec<ValueInfoProto>,
            #[prost(message, repeated, tag = "12")]
            pub output: Vec<ValueInfoProto>,
            #[prost(message, repeated, tag = "13")]
            pub value_info: Vec<ValueInfoProto>,
            #[prost(message, repeated, tag = "16")]
            pub metadata_props: Vec<StringStringEntryProto>,
        }
    };
}

graph_message!(GraphProto, NodeProto, prost(message, repeated, tag = "1"));
graph_message!(
    /// A [`GraphProto`] with each node left encoded: the importer decodes one node at a time, so
    /// a large graph is never held whole as protos beside the graph being built.
    LazyGraphProto,
    Bytes,
    prost(bytes = "bytes", repeated, tag = "1")
);

/// A [`NodeProto`]'s outputs alone (decoding skips the other fields).
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeOutputsProto {
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct OperatorSetIdProto {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(int64, tag = "2")]
    pub version: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StringStringEntryProto {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeProto {
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(string, tag = "4")]
    pub op_type: String,
    #[prost(string, tag = "7")]
    pub domain: String,
    #[prost(string, tag = "8")]
    pub overload: String,
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
    #[prost(string, tag = "6")]
    pub doc_string: String,
    #[prost(message, repeated, tag = "9")]
    pub metadata_props: Vec<StringStringEntryProto>,
}

/// `AttributeProto.AttributeType`.
pub mod attribute_type {
    pub const FLOAT: i32 = 1;
    pub const INT: i32 = 2;
    pub const STRING: i32 = 3;
    pub const TENSOR: i32 = 4;
    pub const GRAPH: i32 = 5;
    pub const FLOATS: i32 = 6;
    pub const INTS: i32 = 7;
    pub const STRINGS: i32 = 8;
    pub const GRAPHS: i32 = 10;
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AttributeProto {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "21")]
    pub ref_attr_name: String,
    #[prost(string, tag = "13")]
    pub doc_string: String,
    #[prost(int32, tag = "20")]
    pub r#type: i32,
    #[prost(float, tag = "2")]
    pub f: f32,
    #[prost(int64, tag = "3")]
    pub i: i64,
    #[prost(bytes = "bytes", tag = "4")]
    pub s: Bytes,
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    /// `GraphProto`, kept encoded (decoded only to find outer-scope reads).
    #[prost(bytes = "bytes", optional, tag = "6")]
    pub g: Option<Bytes>,
    #[prost(bytes = "bytes", optional, tag = "22")]
    pub sparse_tensor: Option<Bytes>,
    #[prost(bytes = "bytes", optional, tag = "14")]
    pub tp: Option<Bytes>,
    #[prost(float, repeated, packed = "false", tag = "7")]
    pub floats: Vec<f32>,
    #[prost(int64, repeated, packed = "false", tag = "8")]
    pub ints: Vec<i64>,
    #[prost(bytes = "bytes", repeated, tag = "9")]
    pub strings: Vec<Bytes>,
    #[prost(message, repeated, tag = "10")]
    pub tensors: Vec<TensorProto>,
    #[prost(bytes = "bytes", repeated, tag = "11")]
    pub graphs: Vec<Bytes>,
    #[prost(bytes = "bytes", repeated, tag = "23")]
    pub sparse_tensors: Vec<Bytes>,
    #[prost(bytes = "bytes", repeated, tag = "15")]
    pub type_protos: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueInfoProto {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
    #[prost(string, tag = "3")]
    pub doc_string: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TypeProto {
    #[prost(oneof = "type_proto::Value", tags = "1, 4, 5, 9, 8")]
    pub value: Option<type_proto::Value>,
    #[prost(string, tag = "6")]
    pub denotation: String,
}

pub mod type_proto {
    use bytes::Bytes;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Tensor {
        #[prost(int32, tag = "1")]
        pub elem_type: i32,
        #[prost(message, optional, tag = "2")]
        pub shape: Option<super::TensorShapeProto>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(message, tag = "1")]
        TensorType(Tensor),
        /// Sequence, map, optional and sparse types are not modelled: kept encoded.
        #[prost(bytes = "bytes", tag = "4")]
        SequenceType(Bytes),
        #[prost(bytes = "bytes", tag = "5")]
        MapType(Bytes),
        #[prost(bytes = "bytes", tag = "9")]
        OptionalType(Bytes),
        #[prost(bytes = "bytes", tag = "8")]
        SparseTensorType(Bytes),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<tensor_shape_proto::Dimension>,
}

pub mod tensor_shape_proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dimension {
        #[prost(oneof = "dimension::Value", tags = "1, 2")]
        pub value: Option<dimension::Value>,
        #[prost(string, tag = "3")]
        pub denotation: String,
    }

    pub mod dimension {
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            #[prost(int64, tag = "1")]
            DimValue(i64),
            #[prost(string, tag = "2")]
            DimParam(String),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    #[prost(int64, repeated, packed = "false", tag = "1")]
    pub dims: Vec<i64>,
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    #[prost(message, optional, tag = "3")]
    pub segment: Option<tensor_proto::Segment>,
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    #[prost(bytes = "bytes", repeated, tag = "6")]
    pub string_data: Vec<Bytes>,
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    #[prost(string, tag = "8")]
    pub name: String,
    #[prost(string, tag = "12")]
    pub doc_string: String,
    #[prost(bytes = "bytes", tag = "9")]
    pub raw_data: Bytes,
    #[prost(message, repeated, tag = "13")]
    pub external_data: Vec<StringStringEntryProto>,
    #[prost(int32, tag = "14")]
    pub data_location: i32,
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    #[prost(uint64, repeated, tag = "11")]
    pub uint64_data: Vec<u64>,
}

pub mod tensor_proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Segment {
        #[prost(int64, tag = "1")]
        pub begin: i64,
        #[prost(int64, tag = "2")]
        pub end: i64,
    }

    /// `TensorProto.DataLocation.EXTERNAL`.
    pub const EXTERNAL: i32 = 1;
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SparseTensorProto {
    #[prost(message, optional, tag = "1")]
    pub values: Option<TensorProto>,
    #[prost(message, optional, tag = "2")]
    pub indices: Option<TensorProto>,
    #[prost(int64, repeated, packed = "false", tag = "3")]
    pub dims: Vec<i64>,
}
