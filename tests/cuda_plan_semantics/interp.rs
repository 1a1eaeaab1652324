//! The interpreter of plan calls: the memory a plan runs over and its kernels' meaning (the
//! element-wise, movement, reduction and im2col families here; the others in `more.rs`; the
//! libraries' calls in `libraries.rs`).

use std::collections::HashMap;

use mpc_ir::ops::Unary;
use mpc_ir::DType;
use mpc_runtime::cuda::plan::{Arg, Buf, Call, Kernel, LaunchPlan, Window3};
use mpc_runtime::program::Region;
use mpc_runtime::HostTensor;

use super::libraries::*;
use super::more::*;

/// The bytes a plan runs over: the program's three regions, the workspace and the aux bytes.
#[derive(Clone)]
pub(crate) struct Memory {
    pub(crate) arena: Vec<u8>,
    pub(crate) state: Vec<u8>,
    pub(crate) constants: Vec<u8>,
    pub(crate) work: Vec<u8>,
    /// Where the launch's scratch lies in the arena, if there (bytes free during the launch, as
    /// the CUDA device places it), else in `work`.
    pub(crate) work_in_arena: Option<u64>,
    pub(crate) aux: Vec<u8>,
    pub(crate) flag: Vec<u8>,
    /// The buffers whose addresses the aux bytes hold, by aux offset.
    pub(crate) addresses: HashMap<u64, Buf>,
    /// Run the kernels from their source (`emu.rs`) instead of interpreting them.
    pub(crate) emulated: Option<super::emu::Kernels>,
}

impl Memory {
    pub(crate) fn at(&mut self, b: Buf) -> (&mut Vec<u8>, usize) {
        match b {
            Buf::Tensor(Region::Arena, o) => (&mut self.arena, o as usize),
            Buf::Tensor(Region::State, o) => (&mut self.state, o as usize),
            Buf::Tensor(Region::Constants, o) => (&mut self.constants, o as usize),
            Buf::Work(o) => match self.work_in_arena {
                Some(at) => (&mut self.arena, (at + o) as usize),
                None => (&mut self.work, o as usize),
            },
            Buf::Aux(o) => (&mut self.aux, o as usize),
            Buf::Flag => (&mut self.flag, 0),
        }
    }

    pub(crate) fn bytes(&mut self, b: Buf, elem: i64, size: usize) -> Vec<u8> {
        let (v, o) = self.at(b);
        let s = (o as i64 + elem * size as i64) as usize;
        v[s..s + size].to_vec()
    }

    pub(crate) fn put(&mut self, b: Buf, elem: i64, bytes: &[u8]) {
        let (v, o) = self.at(b);
        let s = (o as i64 + elem * bytes.len() as i64) as usize;
        v[s..s + bytes.len()].copy_from_slice(bytes);
    }

    pub(crate) fn get(&mut self, b: Buf, elem: i64, d: DType) -> f64 {
        HostTensor::from_le_bytes(d, vec![1], &self.bytes(b, elem, d.size())).f64s()[0]
    }

    pub(crate) fn set(&mut self, b: Buf, elem: i64, d: DType, v: f64) {
        let t = HostTensor::from_f64(d, vec![1], vec![v]);
        let mut bytes = vec![0u8; d.size()];
        t.write_le_bytes(&mut bytes);
        self.put(b, elem, &bytes);
    }
}

pub(crate) fn ptr(a: &Arg) -> Buf {
    match a {
        Arg::Ptr(b) => *b,
        a => panic!("{a:?} where a pointer was expected"),
    }
}

pub(crate) fn int(a: &Arg) -> i64 {
    match *a {
        Arg::I64(v) => v,
        Arg::I32(v) => v as i64,
        ref a => panic!("{a:?} where an integer was expected"),
    }
}

pub(crate) fn dims(a: &Arg) -> [i64; 8] {
    match a {
        Arg::Dims(d) => *d,
        a => panic!("{a:?} where Dims8 was expected"),
    }
}

pub(crate) fn window(a: &Arg) -> Window3 {
    match a {
        Arg::Window(w) => *w,
        a => panic!("{a:?} where Window3 was expected"),
    }
}

pub(crate) fn dtype_of(tag: &str) -> DType {
    tag.parse().unwrap_or_else(|e| panic!("dtype tag {tag}: {e}"))
}

/// The coordinates of row-major index `lin` over `dims[..rank]`, dotted with each stride list.
pub(crate) fn offsets(mut lin: i64, rank: usize, d: &[i64; 8], strides: &[[i64; 8]]) -> Vec<i64> {
    let mut out = vec![0i64; strides.len()];
    for k in (0..rank).rev() {
        let c = lin % d[k];
        lin /= d[k];
        for (o, s) in out.iter_mut().zip(strides) {
            *o += c * s[k];
        }
    }
    out
}

/// `(kind, finish)` of the two-pass reduction kernels this file interprets: `reduce_<kind>_cols_split_<T>`
/// (false) and `reduce_<kind>_finish_<T>` (true).
pub(crate) fn split_reduce(name: &str) -> Option<(&str, bool)> {
    let rest = name.strip_prefix("reduce_")?;
    let (kind, finish) = match (rest.split_once("_cols_split_"), rest.split_once("_finish_")) {
        (Some((k, _)), _) => (k, false),
        (_, Some((k, _))) => (k, true),
        _ => return None,
    };
    ["sum", "mean", "max", "min", "prod", "sum_square", "l1", "l2"].contains(&kind).then_some((kind, finish))
}

/// The kernels whose meaning this file interprets.
pub(crate) fn call_interpretable(c: &Call) -> bool {
    match c {
        Call::Kernel(k) => interpretable(k),
        Call::Conv(conv) => conv.fallback.iter().all(call_interpretable),
        Call::Lt(lt) => lt.fallback.iter().all(call_interpretable),
        _ => true,
    }
}

pub(crate) fn interpretable(k: &Kernel) -> bool {
    if k.fused.is_some() {
        return true;
    }
    let reduce = ["sum", "mean", "max", "min", "prod", "sum_square", "l1", "l2", "log_sum_exp", "argmax", "argmin"]
        .iter()
        .any(|r| k.name.starts_with(&format!("reduce_{r}_rows_")) || k.name.starts_with(&format!("reduce_{r}_cols_")))
        || split_reduce(&k.name).is_some();
    let unary = unary_kernel(k).is_some();
    let binary = BINARY.contains(&elementwise_op(&k.name)) && k.args.len() == 8;
    reduce
        || unary
        || binary
        || [
            "movement_copy_",
            "movement_transpose_",
            "movement_fill_",
            "im2col_im2col_",
            "im2col_col2im_",
            "im2col_channel_sum_",
            "casts_",
            "softmax_softmax_",
            "softmax_log_softmax_",
            "norm_layer_norm_",
            "gather_axis_",
            "gather_elements_",
            "gather_nd_",
            "gather_scatter_nd_",
            "gather_scatter_elements_",
        ]
        .iter()
        .any(|p| k.name.starts_with(p) && !k.name.contains("_grad"))
        || MORE.iter().any(|p| k.name.starts_with(p))
}

/// `op` of a kernel named `elementwise_<op>_<tag>` ("" for another family).
pub(crate) fn elementwise_op(name: &str) -> &str {
    match (name.strip_prefix("elementwise_"), name.rsplit_once('_')) {
        (Some(rest), Some((_, tag))) => &rest[..rest.len() - tag.len() - 1],
        _ => "",
    }
}

/// The unary op of an `elementwise_<op>_<tag>` kernel of five arguments (x, y, n and the two
/// parameters), as mpc-ir describes it.
pub(crate) fn unary_kernel(k: &Kernel) -> Option<Unary> {
    let op = elementwise_op(&k.name);
    Unary::all().find(|u| u.name() == op).filter(|_| k.args.len() == 5)
}

pub(crate) const BINARY: [&str; 7] = ["add", "sub", "mul", "div", "max", "min", "pow"];

/// A fused chain's kernel: each input read at the offsets its strides give, the steps run with
/// the CPU's kernels over the output's shape, the outputs stored.
fn run_fused(m: &mut Memory, k: &Kernel, f: &mpc_runtime::cuda::plan::fused::Fused) {
    let n = int(k.args.last().unwrap());
    let at = |i: i64, st: &[i64]| {
        let (mut r, mut o) = (i, 0);
        for d in (0..f.dims.len()).rev() {
            o += (r % f.dims[d]) * st[d];
            r /= f.dims[d];
        }
        o
    };
    // Elements taken `vector` at a time: every tensor read or written whole starts on a multiple
    // of that many elements' bytes, and the count is a multiple of it.
    if f.vector > 1 {
        let mut contiguous = vec![1i64; f.dims.len()];
        for d in (0..f.dims.len().saturating_sub(1)).rev() {
            contiguous[d] = contiguous[d + 1] * f.dims[d + 1];
        }
        let whole = f.inputs.iter().enumerate().filter(|(_, (_, st))| *st == contiguous).map(|(j, (d, _))| (j, *d));
        let outs = f.outputs.iter().enumerate().map(|(j, d)| (f.inputs.len() + j, *d));
        let whole: Vec<(usize, DType)> = whole.chain(outs).collect();
        // (8 at a time only where each access is then 16 bytes.)
        assert!(f.vector == 4 || whole.iter().all(|(_, d)| d.size() == 2), "{}: {} at a time", k.name, f.vector);
        for (a, d) in whole {
            let Buf::Tensor(_, o) = ptr(&k.args[a]) else { panic!("{}: a fused operand off the regions", k.name) };
            assert_eq!(o % (f.vector * d.size()) as u64, 0, "{}: operand {a} misaligned for {}", k.name, f.vector);
        }
        assert_eq!(n % f.vector as i64, 0, "{}", k.name);
    }
    let ins: Vec<HostTensor> = f
        .inputs
        .iter()
        .enumerate()
        .map(|(j, (d, st))| {
            let b = ptr(&k.args[j]);
            let values: Vec<f64> = (0..n).map(|i| m.get(b, at(i, st), *d)).collect();
            // An input read widened holds its f16/bf16 values as f32 for the steps.
            HostTensor::from_f64(if f.widened[j] { DType::F32 } else { *d }, f.shape.clone(), values)
        })
        .collect();
    let mut steps: Vec<HostTensor> = Vec::new();
    for s in &f.chain.steps {
        let args: Vec<Option<&HostTensor>> = s
            .args
            .iter()
            .map(|a| match *a {
                mpc_runtime::fuse::ChainArg::Input(j) => Some(&ins[j]),
                mpc_runtime::fuse::ChainArg::Step(j) => Some(&steps[j]),
            })
            .collect();
        let r = mpc_runtime::cpu::run_op(&s.op, &args, 1).unwrap().remove(0);
        assert_eq!(r.dtype(), s.dtype, "{}", s.node);
        steps.push(r);
    }
    for (j, (&step, &d)) in f.chain.outputs.iter().zip(&f.outputs).enumerate() {
        let b = ptr(&k.args[f.inputs.len() + j]);
        let v = steps[step].f64s();
        for i in 0..n {
            m.set(b, i, d, v[i as usize]);
        }
    }
}

pub(crate) fn run_kernel(m: &mut Memory, k: &Kernel) {
    if let Some(f) = &k.fused {
        return run_fused(m, k, f);
    }
    let a = &k.args;
    let tag = k.name.rsplit('_').next().unwrap();
    if k.name.starts_with("movement_copy_") {
        let size: usize = tag[1..].parse().unwrap();
        let (x, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]) as usize);
        let (d, xs, ys) = (dims(&a[4]), dims(&a[5]), dims(&a[6]));
        for i in 0..n {
            let (xo, yo) = if rank == 0 {
                (i, i)
            } else {
                let o = offsets(i, rank, &d, &[xs, ys]);
                (o[0], o[1])
            };
            let v = m.bytes(x, xo, size);
            m.put(y, yo, &v);
        }
    } else if k.name.starts_with("movement_transpose_") {
        let size: usize = tag[1..].parse().unwrap();
        let (x, y, batch, rank) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]) as usize);
        let (d, xs, ys) = (dims(&a[4]), dims(&a[5]), dims(&a[6]));
        let (rows, cols, x_col, y_row) = (int(&a[7]), int(&a[8]), int(&a[9]), int(&a[10]));
        assert_eq!((k.block, k.grid[0] as i64, k.grid[1] as i64), ([32, 8, 1], (cols + 31) / 32, (rows + 31) / 32));
        for b in 0..batch {
            let (xb, yb) = if rank == 0 {
                (0, 0)
            } else {
                let o = offsets(b, rank, &d, &[xs, ys]);
                (o[0], o[1])
            };
            for r in 0..rows {
                for c in 0..cols {
                    let v = m.bytes(x, xb + r + c * x_col, size);
                    m.put(y, yb + r * y_row + c, &v);
                }
            }
        }
    } else if k.name.starts_with("movement_fill_") {
        let size: usize = tag[1..].parse().unwrap();
        let (y, n) = (ptr(&a[0]), int(&a[1]));
        let Arg::U64(v) = a[2] else { panic!("fill value") };
        for i in 0..n {
            m.put(y, i, &v.to_le_bytes()[..size]);
        }
    } else if let Some(op) = BINARY.iter().find(|&&b| b == elementwise_op(&k.name) && k.args.len() == 8) {
        let d = dtype_of(tag);
        let (pa, pb, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]) as usize);
        let (dd, sa, sb) = (dims(&a[5]), dims(&a[6]), dims(&a[7]));
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let (oa, ob) = if rank == 0 {
                (i, i)
            } else {
                let o = offsets(i, rank, &dd, &[sa, sb]);
                (o[0], o[1])
            };
            let (x, z) = (m.get(pa, oa, d), m.get(pb, ob, d));
            out.push(match *op {
                "add" => x + z,
                "sub" => x - z,
                "mul" => x * z,
                "div" => x / z,
                "max" => x.max(z),
                "pow" => x.powf(z),
                _ => x.min(z),
            });
        }
        // Every element is read before any is written (y may be a).
        for (i, v) in out.into_iter().enumerate() {
            m.set(y, i as i64, d, v);
        }
    } else if k.name.starts_with("im2col_im2col_") || k.name.starts_with("im2col_col2im_") {
        let d = dtype_of(tag);
        // The wide col2im reads f32 columns.
        let dc = if k.name.starts_with("im2col_col2im_wide_") { DType::F32 } else { d };
        let (src, dst) = (ptr(&a[0]), ptr(&a[1]));
        let (imgs, channels, img_stride, ch_stride) = (int(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
        let (w, col_ld, col_img) = (window(&a[6]), int(&a[7]), int(&a[8]));
        let nsp = w.nsp as usize;
        let kvol: i64 = w.k[..nsp].iter().product();
        let ovol: i64 = w.out[..nsp].iter().product();
        let ivol: i64 = w.inp[..nsp].iter().product();
        let to_col = k.name.starts_with("im2col_im2col_");
        // The image element each (kernel offset, output position) tap reads, if inside.
        let tap = |kp: i64, op: i64| -> Option<i64> {
            let (mut kr, mut or, mut off, mut scale) = (kp, op, 0i64, 1i64);
            for s in (0..nsp).rev() {
                let (kc, oc) = (kr % w.k[s], or % w.out[s]);
                kr /= w.k[s];
                or /= w.out[s];
                let i = oc * w.stride[s] + kc * w.dil[s] - w.pad[s];
                if i < 0 || i >= w.inp[s] {
                    return None;
                }
                off += i * scale;
                scale *= w.inp[s];
            }
            Some(off)
        };
        let mut sums: HashMap<i64, f64> = HashMap::new();
        for img in 0..imgs {
            for c in 0..channels {
                for kp in 0..kvol {
                    for op in 0..ovol {
                        let col_at = (c * kvol + kp) * col_ld + img * col_img + op;
                        let image = tap(kp, op).map(|i| img * img_stride + c * ch_stride + i);
                        if to_col {
                            let v = image.map_or(0.0, |at| m.get(src, at, d));
                            m.set(dst, col_at, d, v);
                        } else if let Some(at) = image {
                            *sums.entry(at).or_default() += m.get(src, col_at, dc);
                        }
                    }
                }
            }
        }
        if !to_col {
            for img in 0..imgs {
                for c in 0..channels {
                    for i in 0..ivol {
                        let at = img * img_stride + c * ch_stride + i;
                        m.set(dst, at, d, sums.get(&at).copied().unwrap_or(0.0));
                    }
                }
            }
        }
    } else if k.name.starts_with("im2col_channel_sum_") {
        let d = dtype_of(tag);
        let (dy, db, n, c, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for ch in 0..c {
            let mut s = 0.0;
            for b in 0..n {
                for i in 0..inner {
                    s += m.get(dy, (b * c + ch) * inner + i, d);
                }
            }
            m.set(db, ch, d, s);
        }
    } else if let Some(u) = unary_kernel(k) {
        let d = dtype_of(tag);
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]));
        let params = [f32_of(&a[3]) as f32, f32_of(&a[4]) as f32];
        for i in 0..n {
            let v = m.get(x, i, d);
            m.set(y, i, d, u.eval(params, v));
        }
    } else if k.name.starts_with("casts_") {
        let (from, to) = k.name["casts_".len()..].split_once("_to_").unwrap();
        let tag = |t: &str| if t == "bool" { DType::Bool } else { dtype_of(t) };
        let (df, dt) = (tag(from), tag(to));
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]) as usize);
        let src = HostTensor::from_le_bytes(df, vec![n], &m.bytes(x, 0, n * df.size()));
        let out = src.cast(dt);
        let mut bytes = vec![0u8; out.bytes()];
        out.write_le_bytes(&mut bytes);
        m.put(y, 0, &bytes);
    } else if let Some((kind, finish)) = split_reduce(&k.name) {
        // Two passes: partials over chunks of the reduced axis (in the accumulator dtype), then
        // each output's partials combined and finalised.
        let d = dtype_of(tag);
        let acc = if d == DType::F64 {
            DType::F64
        } else if d.is_float() {
            DType::F32
        } else {
            DType::I64
        };
        let combine = |a: f64, b: f64| match kind {
            "max" => a.max(b),
            "min" => a.min(b),
            "prod" => a * b,
            _ => a + b,
        };
        let id = match kind {
            "max" => f64::NEG_INFINITY,
            "min" => f64::INFINITY,
            "prod" => 1.0,
            _ => 0.0,
        };
        if finish {
            let (part, y, nout, splits, reduced) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
            for out in 0..nout {
                let v = (0..splits).map(|s| m.get(part, out * splits + s, acc)).fold(id, combine);
                let v = match kind {
                    "mean" => v / reduced.max(1) as f64,
                    "l2" => v.sqrt(),
                    _ => v,
                };
                m.set(y, out, d, v);
            }
        } else {
            let (x, part, outer, reduced, inner, splits) =
                (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
            let chunk = (reduced + splits - 1) / splits;
            for o in 0..outer {
                for s in 0..splits {
                    for i in 0..inner {
                        let v = (s * chunk..((s + 1) * chunk).min(reduced))
                            .map(|r| {
                                let e = m.get(x, (o * reduced + r) * inner + i, d);
                                match kind {
                                    "sum_square" | "l2" => e * e,
                                    "l1" => e.abs(),
                                    _ => e,
                                }
                            })
                            .fold(id, combine);
                        m.set(part, (o * inner + i) * splits + s, acc, v);
                    }
                }
            }
        }
    } else if k.name.starts_with("reduce_") {
        let kind = k.name["reduce_".len()..]
            .rsplit_once(if k.name.contains("_rows_") { "_rows_" } else { "_cols_" })
            .unwrap()
            .0;
        let d = dtype_of(tag);
        let (x, y, outer, reduced, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for o in 0..outer {
            for i in 0..inner {
                let v: Vec<f64> = (0..reduced).map(|r| m.get(x, (o * reduced + r) * inner + i, d)).collect();
                let at = o * inner + i;
                let arg = |best: &dyn Fn(f64, f64) -> bool| {
                    let mut b = 0usize;
                    for (j, &e) in v.iter().enumerate() {
                        if best(e, v[b]) || (int(&a[5]) != 0 && e == v[b]) {
                            b = j;
                        }
                    }
                    b as f64
                };
                let r = match kind {
                    "sum" => v.iter().sum(),
                    "mean" => v.iter().sum::<f64>() / (reduced.max(1) as f64),
                    "max" => v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    "min" => v.iter().copied().fold(f64::INFINITY, f64::min),
                    "prod" => v.iter().product(),
                    "sum_square" => v.iter().map(|e| e * e).sum(),
                    "l1" => v.iter().map(|e| e.abs()).sum(),
                    "l2" => v.iter().map(|e| e * e).sum::<f64>().sqrt(),
                    "log_sum_exp" => {
                        // Shifted by a finite maximum only (as the kernels): inf - inf is NaN.
                        let mx = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let mx = if mx.is_finite() { mx } else { 0.0 };
                        v.iter().map(|e| (e - mx).exp()).sum::<f64>().ln() + mx
                    }
                    "argmax" => arg(&|e, b| e > b),
                    _ => arg(&|e, b| e < b),
                };
                let dy = if kind.starts_with("arg") { DType::I64 } else { d };
                m.set(y, at, dy, r);
            }
        }
    } else if (k.name.starts_with("softmax_softmax_") || k.name.starts_with("softmax_log_softmax_"))
        && !k.name.contains("_grad")
    {
        let d = dtype_of(tag);
        let log = k.name.starts_with("softmax_log_softmax_");
        let (x, y, outer, n, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: i64| (o * n + j) * inner + i;
                let v: Vec<f64> = (0..n).map(|j| m.get(x, at(j), d)).collect();
                let mx = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = v.iter().map(|e| (e - mx).exp()).sum();
                for (j, e) in v.iter().enumerate() {
                    let r = if log { e - mx - s.ln() } else { (e - mx).exp() / s };
                    m.set(y, at(j as i64), d, r);
                }
            }
        }
    } else if k.name.starts_with("norm_layer_norm_") && !k.name.contains("_grad") {
        // norm_layer_norm_<x>_<params>[_y<low>]: y written in <low> when the suffix is there.
        let tags: Vec<&str> = k.name["norm_layer_norm_".len()..].split('_').collect();
        let (d, dp) = (dtype_of(tags[0]), dtype_of(tags[1]));
        let dy = tags.get(2).map_or(d, |t| dtype_of(t.strip_prefix('y').expect("a _y<dtype> suffix")));
        let (x, scale, bias, y) = (ptr(&a[0]), ptr(&a[1]), a[2], ptr(&a[3]));
        let (mean_out, inv_out) = (a[4], a[5]);
        let (rows, n, sn) = (int(&a[6]), int(&a[7]), int(&a[8]));
        let Arg::F32(eps) = a[9] else { panic!("eps") };
        for r in 0..rows {
            let v: Vec<f64> = (0..n).map(|j| m.get(x, r * n + j, d)).collect();
            let mean = v.iter().sum::<f64>() / n as f64;
            let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for (j, e) in v.iter().enumerate() {
                let b = if let Arg::Ptr(b) = bias { m.get(b, j as i64 % sn, dp) } else { 0.0 };
                let out = (e - mean) * inv * m.get(scale, j as i64 % sn, dp) + b;
                m.set(y, r * n + j as i64, dy, out);
            }
            if let Arg::Ptr(p) = mean_out {
                m.set(p, r, acc(d), mean);
            }
            if let Arg::Ptr(p) = inv_out {
                m.set(p, r, acc(d), inv);
            }
        }
    } else if k.name.starts_with("gather_axis_")
        || k.name.starts_with("gather_elements_")
        || k.name.starts_with("gather_nd_")
    {
        // Named by element size and index dtype: gather_<kind>_b<size>_<index tag>.
        let parts: Vec<&str> = k.name.rsplitn(3, '_').collect();
        let (size, di): (usize, DType) = (parts[1][1..].parse().unwrap(), dtype_of(parts[0]));
        let (x, idx, y) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]));
        let index = |m: &mut Memory, j: i64, len: i64| {
            let v = m.get(idx, j, di) as i64;
            let v = if v < 0 { v + len } else { v };
            assert!((0..len).contains(&v), "{}: index out of range", k.name);
            v
        };
        if k.name.starts_with("gather_axis_") {
            let (outer, len, count, inner) = (int(&a[3]), int(&a[4]), int(&a[5]), int(&a[6]));
            for o in 0..outer {
                for j in 0..count {
                    let l = index(m, j, len);
                    for i in 0..inner {
                        let v = m.bytes(x, (o * len + l) * inner + i, size);
                        m.put(y, (o * count + j) * inner + i, &v);
                    }
                }
            }
        } else if k.name.starts_with("gather_elements_") {
            let (n, rank, d, xs, axis, len) =
                (int(&a[3]), int(&a[4]) as usize, dims(&a[5]), dims(&a[6]), int(&a[7]) as usize, int(&a[8]));
            for e in 0..n {
                let mut xs_no_axis = xs;
                xs_no_axis[axis] = 0;
                let off = offsets(e, rank, &d, &[xs_no_axis])[0] + index(m, e, len) * xs[axis];
                let v = m.bytes(x, off, size);
                m.put(y, e, &v);
            }
        } else {
            let (tuples, kk, run, per_batch, batch_len) = (int(&a[3]), int(&a[4]), int(&a[5]), int(&a[6]), int(&a[7]));
            let (d, st) = (dims(&a[8]), dims(&a[9]));
            for t in 0..tuples {
                let mut off = (t / per_batch) * batch_len;
                for j in 0..kk {
                    off += index(m, t * kk + j, d[j as usize]) * st[j as usize];
                }
                for r in 0..run {
                    let v = m.bytes(x, off + r, size);
                    m.put(y, t * run + r, &v);
                }
            }
        }
    } else if k.name.starts_with("gather_scatter_") {
        let parts: Vec<&str> = k.name.rsplitn(3, '_').collect();
        let (d, di) = (dtype_of(parts[1]), dtype_of(parts[0]));
        let (idx, upd, out, n_out) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
        let red = int(&a[a.len() - 2]);
        // f16/bf16 accumulate in f32 and round once: hold the output as f64 until the end.
        let mut acc: Vec<f64> = (0..n_out).map(|o| m.get(out, o, d)).collect();
        let combine = |old: f64, u: f64| match red {
            0 => u,
            1 => old + u,
            2 => old * u,
            3 => old.max(u),
            _ => old.min(u),
        };
        let index = |m: &mut Memory, j: i64, len: i64| {
            let v = m.get(idx, j, di) as i64;
            if v < 0 {
                v + len
            } else {
                v
            }
        };
        if k.name.starts_with("gather_scatter_nd_") {
            let (tuples, kk, run, dd, st) = (int(&a[4]), int(&a[5]), int(&a[6]), dims(&a[7]), dims(&a[8]));
            for t in 0..tuples {
                let mut dst = 0;
                for j in 0..kk {
                    dst += index(m, t * kk + j, dd[j as usize]) * st[j as usize];
                }
                for r in 0..run {
                    let u = m.get(upd, t * run + r, d);
                    acc[(dst + r) as usize] = combine(acc[(dst + r) as usize], u);
                }
            }
        } else {
            let (n_upd, rank, idd, os, axis, len) =
                (int(&a[4]), int(&a[5]) as usize, dims(&a[6]), dims(&a[7]), int(&a[8]) as usize, int(&a[9]));
            let mut os_no_axis = os;
            os_no_axis[axis] = 0;
            for u in 0..n_upd {
                let dst = offsets(u, rank, &idd, &[os_no_axis])[0] + index(m, u, len) * os[axis];
                acc[dst as usize] = combine(acc[dst as usize], m.get(upd, u, d));
            }
        }
        for (o, v) in acc.into_iter().enumerate() {
            m.set(out, o as i64, d, v);
        }
    } else if MORE.iter().any(|p| k.name.starts_with(p)) {
        run_more(m, k);
    } else {
        panic!("{} is not interpreted", k.name);
    }
}

/// Runs a plan's calls; a convolution as cuDNN computes it and a product with an epilogue as
/// cuBLASLt does (`library`), or each as its fallback.
pub(crate) fn run_plan(m: &mut Memory, p: &LaunchPlan, library: bool) {
    // Where the library runs a convolution, its fallback's columns are not in the workspace.
    let work = if library { p.workspace } else { p.workspace_with_fallbacks() };
    m.work = vec![0xFF; work as usize];
    m.aux = p.aux.clone();
    m.addresses = p.addresses.iter().copied().collect();
    for c in &p.calls {
        run_call(m, c, library);
    }
}

pub(crate) fn run_call(m: &mut Memory, c: &Call, library: bool) {
    match c {
        Call::Kernel(k) => match m.emulated.clone() {
            Some(e) => e.launch(k, m),
            None => run_kernel(m, k),
        },
        Call::Gemm(g) => run_gemm(m, g),
        Call::Copy { from, to, bytes } => {
            let v = m.bytes(*from, 0, *bytes as usize);
            m.put(*to, 0, &v);
        }
        Call::Fill { to, bytes, byte } => m.put(*to, 0, &vec![*byte; *bytes as usize]),
        Call::Conv(conv) if library => run_dnn(m, conv),
        Call::Conv(conv) => conv.fallback.iter().for_each(|c| run_call(m, c, library)),
        Call::Lt(lt) if library => run_lt(m, lt),
        Call::Lt(lt) => lt.fallback.iter().for_each(|c| run_call(m, c, library)),
    }
}
