//! What the fuzz targets run, and their structure-aware mutations.
//!
//! [`exercise`] takes a graph the way `mpc compile` and `mpc run` do: the passes under fp32 or
//! mixed, the result written as ONNX and as text IR and read back (mpc must read what it
//! writes), then bound at small sizes, lowered for the CPU device under a small memory limit and
//! run on random inputs. An `Err` of the input's class (mpc's exit 2) is a clean refusal; a panic,
//! an abort, a signal, a hang or a memory blow-up is a finding, and so is an output mpc cannot read
//! back or an error of mpc's own class (exit 1: a pass left the graph invalid, a lowered program or
//! a kernel broke an invariant), which the validation of the input should have prevented.

use std::collections::HashMap;
use std::path::Path;

use mpc::{Format, Options};
use mpc_ir::onnx::proto::{self, attribute_type as at, tensor_shape_proto::dimension, type_proto, ModelProto};
use mpc_ir::Graph;
use mpc_runtime::device::{CpuDevice, Device, DeviceOptions};
use prost::Message;

/// The most bytes one lowered program may hold here: small graphs stay fast.
pub const MEMORY_LIMIT: u64 = 4 << 20;
/// Steps whose matrix products and convolutions cost more are lowered but not run.
pub const MAX_FLOPS: u64 = 50_000_000;

/// Compiles `g` under fp32 or, with `mixed`, the mixed policy; writes and reads back the
/// result; lowers and runs it. (One policy per input: the input's last byte picks it, so both
/// get half the executions.)
pub fn exercise(mut g: Graph, mixed: bool) {
    let path = Path::new("fuzz.onnx");
    let policy = if mixed { "mixed" } else { "fp32" };
    let opts = Options { policy: Some(policy.into()), ..Default::default() };
    if let Err(e) = mpc::compile(&mut g, path, &opts, &mut |_, _| {}) {
        return refused(&e);
    }
    read_back(&g, path);
    run(&g, path);
}

/// What mpc writes it must read: the ONNX and the text IR of a compiled graph.
fn read_back(g: &Graph, path: &Path) {
    match mpc::render(g, Format::Onnx, path) {
        Ok((bytes, _)) => {
            if let Err(e) = mpc_ir::onnx::decode_onnx(bytes.into(), None) {
                panic!("mpc cannot read the ONNX it wrote: {e}");
            }
        }
        Err(e) => refused(&e),
    }
    match mpc::render(g, Format::Ir, path) {
        Ok((text, sidecar)) => {
            let text = String::from_utf8(text).expect("text IR is UTF-8");
            if let Err(e) = mpc_ir::text::parse(&text, Some(&sidecar)) {
                panic!("mpc cannot read the text IR it wrote: {e}\n{text}");
            }
        }
        Err(e) => refused(&e),
    }
}

/// Every symbolic dim bound to 2, random inputs, one run on the CPU device.
fn run(g: &Graph, path: &Path) {
    let mut dims = HashMap::new();
    for &v in g.inputs() {
        if let Some(s) = &g.ty(v).shape {
            for d in s.dims() {
                if let mpc_ir::Dim::Sym(e) = d {
                    for s in e.symbols() {
                        dims.insert(s.to_string(), 2);
                    }
                }
            }
        }
    }
    let bound = match mpc::summary::bind_inputs(g, &dims) {
        Ok((bound, _)) => bound,
        Err(source) => return refused(&mpc::Error::Pass { path: path.to_owned(), source }),
    };
    if mpc::summary::flops(&bound).total() > MAX_FLOPS {
        return;
    }
    let feeds = match mpc::run::random_inputs_within(g, 1, &dims, MEMORY_LIMIT) {
        Ok(feeds) => feeds,
        Err(e) => return refused(&e),
    };
    let device = CpuDevice::with_options(DeviceOptions { memory_limit: Some(MEMORY_LIMIT), ..Default::default() });
    let program = match mpc::run::lower_for_inputs(g, &feeds, device.caps(), path) {
        Ok(program) => program,
        Err(e) => return refused(&e),
    };
    let ran = mpc_runtime::session::Session::new(device, program).and_then(|mut s| s.run(&feeds).map(drop));
    if let Err(source) = ran {
        refused(&mpc::Error::Run { path: path.to_owned(), source });
    }
}

/// An error must be the input's fault (mpc's exit 2); one of mpc's own class (exit 1) is a finding.
fn refused(e: &mpc::Error) {
    if e.exit_code() != 2 {
        panic!("mpc's own failure (exit {}): {e}", e.exit_code());
    }
}

/// A small deterministic generator for the mutators.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u32) -> Rng {
        Rng(seed as u64 ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> Option<&'a T> {
        v.get(self.below(v.len()))
    }
}

/// Integers that break arithmetic: zero, one, negatives, the edges of i32 and i64.
const INTERESTING: [i64; 12] = [0, 1, -1, 2, 3, -2, 7, 64, 1 << 31, -(1 << 31), i64::MAX, i64::MIN];

fn interesting(r: &mut Rng) -> i64 {
    match r.below(3) {
        0 => INTERESTING[r.below(INTERESTING.len())],
        1 => r.below(9) as i64 - 4,
        _ => r.next_u64() as i64,
    }
}

/// Mutates an ONNX model's structure: op types, attributes, node inputs and outputs, declared
/// dims and dtypes, initializer data. `None` when the bytes are not a model.
pub fn mutate_onnx(data: &[u8], seed: u32) -> Option<Vec<u8>> {
    let mut m = ModelProto::decode(data).ok()?;
    let mut r = Rng::new(seed);
    let g = m.graph.get_or_insert_with(Default::default);
    for _ in 0..=r.below(3) {
        match r.below(12) {
            0 if !g.node.is_empty() => {
                let i = r.below(g.node.len());
                g.node[i].op_type = mpc_ir::Op::KNOWN[r.below(mpc_ir::Op::KNOWN.len())].to_string();
            }
            1 if !g.node.is_empty() => {
                // An input replaced by another value of the graph, or dropped, or emptied.
                let names: Vec<String> = g
                    .input
                    .iter()
                    .map(|v| v.name.clone())
                    .chain(g.initializer.iter().map(|t| t.name.clone()))
                    .chain(g.node.iter().flat_map(|n| n.output.clone()))
                    .collect();
                let i = r.below(g.node.len());
                let n = &mut g.node[i];
                match r.below(4) {
                    0 if !n.input.is_empty() => {
                        let k = r.below(n.input.len());
                        n.input.remove(k);
                    }
                    1 if !n.input.is_empty() => {
                        let k = r.below(n.input.len());
                        n.input[k] = String::new();
                    }
                    _ => {
                        if let Some(name) = r.pick(&names) {
                            let k = r.below(n.input.len() + 1);
                            if k < n.input.len() {
                                n.input[k] = name.clone();
                            } else {
                                n.input.push(name.clone());
                            }
                        }
                    }
                }
            }
            2 if !g.node.is_empty() => {
                // An attribute's value, kind or name changed, or one added.
                let i = r.below(g.node.len());
                let n = &mut g.node[i];
                if n.attribute.is_empty() || r.below(3) == 0 {
                    let names = ["axis", "axes", "perm", "group", "strides", "pads", "kernel_shape", "to", "keepdims"];
                    let name = names[r.below(names.len())].to_string();
                    n.attribute.push(proto::AttributeProto {
                        name,
                        r#type: at::INT,
                        i: interesting(&mut r),
                        ..Default::default()
                    });
                } else {
                    let k = r.below(n.attribute.len());
                    let a = &mut n.attribute[k];
                    match r.below(5) {
                        0 => a.i = interesting(&mut r),
                        1 => {
                            let len = a.ints.len().max(1);
                            a.ints = (0..len + r.below(2)).map(|_| interesting(&mut r)).collect();
                        }
                        2 => a.f = [0.0, -1.0, f32::NAN, f32::INFINITY, 1e30, 0.5][r.below(6)],
                        3 => a.r#type = r.below(15) as i32,
                        _ => a.name.push('x'),
                    }
                }
            }
            3 if !g.node.is_empty() => {
                let i = r.below(g.node.len());
                let n = g.node.remove(i);
                if r.below(2) == 0 {
                    let j = r.below(g.node.len() + 1);
                    g.node.insert(j, n);
                }
            }
            4 if !g.node.is_empty() => {
                let i = r.below(g.node.len());
                let n = g.node[i].clone();
                let j = r.below(g.node.len() + 1);
                g.node.insert(j, n);
            }
            5 | 6 => {
                // A declared dim of an input, output or value_info.
                let vis: Vec<&mut proto::ValueInfoProto> =
                    g.input.iter_mut().chain(g.output.iter_mut()).chain(g.value_info.iter_mut()).collect();
                let n = vis.len();
                if let Some(vi) = vis.into_iter().nth(r.below(n)) {
                    if let Some(type_proto::Value::TensorType(t)) = vi.r#type.as_mut().and_then(|t| t.value.as_mut()) {
                        if r.below(4) == 0 {
                            t.elem_type = r.below(27) as i32;
                        } else if let Some(s) = t.shape.as_mut() {
                            let len = s.dim.len();
                            let value = match r.below(3) {
                                0 => dimension::Value::DimParam(["batch", "n", "2*batch", "seq-1"][r.below(4)].into()),
                                _ => dimension::Value::DimValue(interesting(&mut r)),
                            };
                            let dim =
                                proto::tensor_shape_proto::Dimension { value: Some(value), denotation: String::new() };
                            match r.below(3) {
                                0 if len > 0 => {
                                    s.dim.remove(r.below(len));
                                }
                                1 => s.dim.insert(r.below(len + 1), dim),
                                _ if len > 0 => s.dim[r.below(len)] = dim,
                                _ => s.dim.push(dim),
                            }
                        }
                    }
                }
            }
            7 if !g.initializer.is_empty() => {
                // An initializer's dims, dtype or data.
                let i = r.below(g.initializer.len());
                let t = &mut g.initializer[i];
                match r.below(4) {
                    0 if !t.dims.is_empty() => {
                        let k = r.below(t.dims.len());
                        t.dims[k] = interesting(&mut r);
                    }
                    1 => t.data_type = r.below(27) as i32,
                    2 => {
                        let mut raw = t.raw_data.to_vec();
                        let k = r.below(raw.len() + 1);
                        raw.truncate(k);
                        t.raw_data = raw.into();
                    }
                    _ => {
                        let v: Vec<i64> = (0..t.int64_data.len().max(1)).map(|_| interesting(&mut r)).collect();
                        t.int64_data = v;
                    }
                }
            }
            8 => {
                let v = [7, 9, 11, 13, 17, 18, 21, 23, 30][r.below(9)];
                match m.opset_import.first_mut() {
                    Some(o) => o.version = v,
                    None => m.opset_import.push(proto::OperatorSetIdProto { domain: String::new(), version: v }),
                }
            }
            9 if !g.output.is_empty() => {
                let names: Vec<String> = g.node.iter().flat_map(|n| n.output.clone()).collect();
                if let Some(name) = r.pick(&names) {
                    let k = r.below(g.output.len());
                    g.output[k].name = name.clone();
                }
            }
            10 if !g.node.is_empty() => {
                let i = r.below(g.node.len());
                let outs = g.node[i].output.len();
                if outs > 0 && r.below(2) == 0 {
                    g.node[i].output.truncate(outs - 1);
                } else {
                    g.node[i].output.push(format!("extra{}", r.below(4)));
                }
            }
            _ => {
                let i = r.below(g.node.len().max(1));
                if let Some(n) = g.node.get_mut(i) {
                    n.domain = ["", "ai.mpc", "com.microsoft", "ai.onnx"][r.below(4)].into();
                }
            }
        }
    }
    Some(m.encode_to_vec())
}

/// Mutates text IR by lines and tokens: a line dropped, repeated or swapped, a number, a dim,
/// a dtype, an op or an attribute value replaced.
pub fn mutate_text(text: &str, seed: u32) -> String {
    let mut r = Rng::new(seed);
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        return text.to_string();
    }
    for _ in 0..=r.below(2) {
        let i = r.below(lines.len());
        match r.below(6) {
            0 if lines.len() > 1 => {
                lines.remove(i);
            }
            1 => {
                let l = lines[i].clone();
                lines.insert(r.below(lines.len() + 1), l);
            }
            2 => {
                let j = r.below(lines.len());
                lines.swap(i, j);
            }
            _ => {
                let mut toks: Vec<String> = lines[i].split(' ').map(str::to_string).collect();
                let k = r.below(toks.len());
                let replacement = match r.below(5) {
                    0 => interesting(&mut r).to_string(),
                    1 => ["f32", "f16", "bf16", "i64", "i32", "bool", "u8", "f64"][r.below(8)].to_string(),
                    2 => mpc_ir::Op::KNOWN[r.below(mpc_ir::Op::KNOWN.len())].to_string(),
                    3 => format!("f32[{},{}]", interesting(&mut r), ["batch", "2", "0", "3"][r.below(4)]),
                    _ => format!("%{}", r.below(12)),
                };
                toks[k] = replacement;
                lines[i] = toks.join(" ");
            }
        }
    }
    lines.join("\n") + "\n"
}
