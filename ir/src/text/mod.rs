//! mpc's text IR: a deterministic, human-readable and parseable form of a graph.
//!
//! ```text
//! mpcir 1
//! model ir_version=8 producer_name="torch"
//! opset "" 17
//! graph "mlp"
//!   input %0 "x": f32[batch,64]
//!   init %1 "fc.weight" = f32[10,64]@sidecar(0, 2560)
//!   init %2 "fc.bias" = f32[10]{...}
//!   %3 "logits": f32[batch,10] = Gemm[transB=1](%0, %1, %2) @"/fc/Gemm"
//!   output %3
//! end
//! ```
//!
//! Values are numbered in topological order (inputs, initializers, then node outputs) and keep
//! their names; `_` is an omitted optional input; opaque ops are written `domain::OpType` (`::TopK`
//! in the standard domain) and the outer-scope values their subgraphs read follow a `|`. Tensors
//! are written inline, in a sidecar file of raw little-endian data (`@sidecar(offset, length)`,
//! the file being the text file's name plus `.bin`), or elided (`{...}`) in summaries such as
//! snapshots, which the parser rejects.

mod parse;
mod print;

use crate::{Graph, Result};

pub const FORMAT_VERSION: i64 = 1;

/// How tensor data is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorMode {
    /// Every element inline.
    Inline,
    /// Tensors of more than `max_inline` elements go to the sidecar.
    Sidecar { max_inline: usize },
    /// Float tensors of more than one element, and any tensor of more than `max_inline`
    /// elements, are elided: readable, not parseable.
    Summary { max_inline: usize },
}

impl TensorMode {
    /// Sidecar mode as `mpc compile -o x.mpcir` writes it.
    pub const FILE: TensorMode = TensorMode::Sidecar { max_inline: 16 };
    /// Summary mode for stdout and snapshots: small shape/axes constants stay visible.
    pub const SUMMARY: TensorMode = TensorMode::Summary { max_inline: 8 };
}

/// Printed text and the sidecar bytes (empty unless [`TensorMode::Sidecar`] put data there).
pub struct Printed {
    pub text: String,
    pub sidecar: Vec<u8>,
}

/// Prints a graph.
pub fn print(g: &Graph, mode: TensorMode) -> Result<Printed> {
    print::Printer::new(g, mode).print()
}

/// Prints a graph with small tensors inline and large ones elided.
pub fn to_summary(g: &Graph) -> Result<String> {
    Ok(print(g, TensorMode::SUMMARY)?.text)
}

/// Parses text IR; `sidecar` holds the data that `@sidecar(...)` tensors refer to.
pub fn parse(text: &str, sidecar: Option<&[u8]>) -> Result<Graph> {
    parse::Parser::new(sidecar).parse(text)
}

pub(crate) fn decode_hex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 || !s.is_ascii() {
        return Err("hex data must be an even number of hex digits".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| format!("bad hex `{}`", &s[i..i + 2])))
        .collect()
}
