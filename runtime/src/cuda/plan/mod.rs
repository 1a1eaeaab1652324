//! What the CUDA device enqueues for each launch of a [`Program`](crate::program::Program),
//! decided once, when a program is loaded, and with no GPU: each [`Launch`] becomes a list of
//! [`Call`]s: kernels of `kernels/*.cu` with their grid, block and argument list (the ABIs in the
//! files' headers), cuBLAS GEMMs, and device copies and fills. Buffers are named by where they lie
//! ([`Buf`]): a program region and offset, the launch's scratch workspace, or its `aux` bytes
//! (values known when lowering that a kernel reads from device memory: Range's start and delta,
//! Mean's divisor). The device resolves them to addresses once, in `prepare`; a step only walks
//! the resolved calls.
//!
//! Because planning needs no GPU, the tests plan every launch of every fixture and check each
//! kernel's name and argument layout against the cubins NVRTC builds ([`super::cubin`]).

use mpc_ir::geometry::{broadcast_strides, slice_dim, Window, WindowSpec};
use mpc_ir::ops::{GeluApprox, PadMode, ReduceKind, Reduction};
use mpc_ir::{normalize_axis, DType, Kind, Op};

use crate::program::{relu_mask_shape, Launch, Operand, Region, TensorRef};
use crate::value::HostTensor;

mod attention;
mod calls;
mod conv;
mod elementwise;
pub mod fused;
mod indexing;
mod linalg;
mod movement;
mod norm;
mod pool;
mod reduce;
mod strided;
mod train;

use attention::*;
pub use calls::*;
use conv::*;
use elementwise::*;
use indexing::*;
use linalg::*;
use movement::*;
use norm::*;
use pool::*;
use reduce::*;
use strided::*;
use train::*;

/// Threads per block of the 1-D kernels (`MPC_BLOCK`).
const BLOCK: u32 = 256;
/// The most blocks a grid-stride launch uses: enough to fill any GPU several times over.
const MAX_GRID: u64 = 8192;
/// The most blocks of a one-block-per-row launch (grid-stride over rows with blockIdx.x).
const MAX_ROWS: u64 = 65535;

fn grid_for(n: u64) -> [u32; 3] {
    [n.div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32, 1, 1]
}

fn rows_grid(rows: u64) -> [u32; 3] {
    [rows.clamp(1, MAX_ROWS) as u32, 1, 1]
}

fn contiguous(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i] as i64;
    }
    s
}

fn us(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

fn numel(s: &[usize]) -> u64 {
    s.iter().map(|&d| d as u64).product()
}

/// The kernel tag of a dtype (`f32`, `i64`, ...): its name, but bool (a 0/1 byte) is `u8`.
fn tag(d: DType) -> Result<&'static str, String> {
    Ok(if d == DType::Bool { "u8" } else { d.name() })
}

fn float_tag(d: DType) -> Result<&'static str, String> {
    match d {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => tag(d),
        d => Err(format!("{d} where the kernels take f32, f16, bf16 or f64")),
    }
}

/// Movement kernels are typed by element size.
fn size_tag(d: DType) -> Result<&'static str, String> {
    Ok(match d.size() {
        1 => "b1",
        2 => "b2",
        4 => "b4",
        8 => "b8",
        n => return Err(format!("{n}-byte elements")),
    })
}

fn index_tag(d: DType) -> Result<&'static str, String> {
    match d {
        DType::I64 => Ok("i64"),
        DType::I32 => Ok("i32"),
        d => Err(format!("{d} indices (i64 or i32 expected)")),
    }
}

fn scalar_bytes(d: DType, v: f64) -> Vec<u8> {
    let t = HostTensor::from_f64(d, vec![], vec![v]);
    let mut b = vec![0u8; t.bytes()];
    t.write_le_bytes(&mut b);
    b
}

/// Builds one launch's plan.
struct Planner<'a> {
    l: &'a Launch,
    opts: PlanOptions,
    constant: &'a dyn Fn(&TensorRef) -> Option<HostTensor>,
    out: LaunchPlan,
    /// The launch's sibling is planned (a Gemm's bias gradient folded into its product).
    sibling_done: bool,
}

fn buf(t: &TensorRef) -> Buf {
    Buf::Tensor(t.region, t.offset)
}

impl<'a> Planner<'a> {
    fn input(&self, i: usize) -> Result<&'a TensorRef, String> {
        match self.l.inputs.get(i) {
            Some(Operand::Device(t)) => Ok(t),
            Some(Operand::Host(_)) => Err(format!("input {i} is a value known when lowering, not a device tensor")),
            Some(Operand::Widened(_)) => Err(format!("input {i} is read widened, which this op's plan does not do")),
            Some(Operand::Transposed(_)) => {
                Err(format!("input {i} is read transposed, which this op's plan does not do"))
            }
            Some(Operand::Permuted(..)) => {
                Err(format!("input {i} is read through a permutation, which this op's plan does not do"))
            }
            _ => Err(format!("input {i} is missing")),
        }
    }

    /// Input `i` and whether the launch reads it widened to f32 ([`Operand::Widened`]).
    fn input_or_widened(&self, i: usize) -> Result<(&'a TensorRef, bool), String> {
        match self.l.inputs.get(i) {
            Some(Operand::Widened(t)) => Ok((t, true)),
            _ => self.input(i).map(|t| (t, false)),
        }
    }

    /// Input `i` and whether the launch reads it with its last two axes swapped
    /// ([`Operand::Transposed`]).
    fn input_or_transposed(&self, i: usize) -> Result<(&'a TensorRef, bool), String> {
        match self.l.inputs.get(i) {
            Some(Operand::Transposed(t)) => Ok((t, true)),
            _ => self.input(i).map(|t| (t, false)),
        }
    }

    fn opt_input(&self, i: usize) -> Option<&'a TensorRef> {
        match self.l.inputs.get(i) {
            Some(Operand::Device(t)) => Some(t),
            _ => None,
        }
    }

    /// A host operand (a shape, axes, pads): its integers.
    fn host_ints(&self, i: usize) -> Option<Vec<i64>> {
        match self.l.inputs.get(i) {
            Some(Operand::Host(t)) => t.i64s(),
            _ => None,
        }
    }

    fn host(&self, i: usize) -> Option<&'a HostTensor> {
        match self.l.inputs.get(i) {
            Some(Operand::Host(t)) => Some(t),
            _ => None,
        }
    }

    fn output(&self, i: usize) -> Result<&'a TensorRef, String> {
        self.l.outputs.get(i).ok_or_else(|| format!("output {i} is missing"))
    }

    fn work(&mut self, bytes: u64) -> Buf {
        let b = Buf::Work(self.out.workspace);
        self.out.workspace += bytes.max(1).next_multiple_of(256);
        b
    }

    fn aux(&mut self, bytes: &[u8]) -> Buf {
        let at = self.out.aux.len().next_multiple_of(16);
        self.out.aux.resize(at, 0);
        self.out.aux.extend_from_slice(bytes);
        Buf::Aux(at as u64)
    }

    fn kernel(&mut self, family: &'static str, name: String, grid: [u32; 3], block: [u32; 3], args: Vec<Arg>) {
        self.out.calls.push(Call::Kernel(Kernel { family, name, grid, block, args, fused: None }));
    }

    /// A 1-D grid-stride kernel over `n` elements.
    fn flat(&mut self, family: &'static str, name: String, n: u64, args: Vec<Arg>) {
        if n > 0 {
            self.kernel(family, name, grid_for(n), [BLOCK, 1, 1], args);
        }
    }

    fn copy(&mut self, from: Buf, to: Buf, bytes: u64) {
        if from != to && bytes > 0 {
            self.out.calls.push(Call::Copy { from, to, bytes });
        }
    }

    /// `x` broadcast to `out` dims, written contiguously to `y`.
    fn expand(&mut self, dtype: DType, x: Buf, shape: &[usize], y: Buf, out: &[usize]) -> Result<(), String> {
        let xs = us(&broadcast_strides(shape, out));
        self.strided_copy(dtype, x, y, out, &xs, &contiguous(out))
    }

    fn cast(&mut self, from: DType, to: DType, x: Buf, y: Buf, n: u64) -> Result<(), String> {
        if from == to {
            self.copy(x, y, n * from.size() as u64);
            return Ok(());
        }
        let t = |d: DType| if d == DType::Bool { Ok("bool") } else { tag(d) };
        let name = format!("casts_{}_to_{}", t(from)?, t(to)?);
        self.flat("casts", name, n, vec![Arg::Ptr(x), Arg::Ptr(y), Arg::I64(n as i64)]);
        Ok(())
    }

    /// A broadcasting binary kernel (`elementwise_<op>_<tag>`): `y = a op b` over `out`.
    fn binary(
        &mut self,
        name: &str,
        tag: &str,
        (a, sa): (Buf, &[usize]),
        (b, sb): (Buf, &[usize]),
        y: Buf,
        out: &[usize],
    ) -> Result<(), String> {
        let n = numel(out);
        let (rank, dims, [xa, xb]) = if sa == out && sb == out {
            (0, [0; 8], [[0; 8]; 2])
        } else {
            let (xa, xb) = (us(&broadcast_strides(sa, out)), us(&broadcast_strides(sb, out)));
            strided_args(out, [&xa, &xb])?
        };
        let args = vec![
            Arg::Ptr(a),
            Arg::Ptr(b),
            Arg::Ptr(y),
            Arg::I64(n as i64),
            Arg::I32(rank),
            Arg::Dims(dims),
            Arg::Dims(xa),
            Arg::Dims(xb),
        ];
        self.flat("elementwise", format!("elementwise_{name}_{tag}"), n, args);
        Ok(())
    }

    /// Appends the calls of `s` (the launch's sibling), in this plan's workspace and aux bytes.
    fn plan_sibling(&mut self, s: &Launch) -> Result<(), String> {
        let mut q = Planner {
            l: s,
            opts: self.opts,
            constant: self.constant,
            out: std::mem::take(&mut self.out),
            sibling_done: true,
        };
        let r = plan_op(&mut q);
        self.out = q.out;
        self.sibling_done = true;
        r
    }

    fn gemm(&mut self, g: Gemm) {
        if g.m > 0 && g.n > 0 && g.batch > 0 {
            self.out.calls.push(Call::Gemm(g));
        }
    }
}

/// Plans one launch; `constant` gives the value of a tensor of the program's constants region
/// (a Pad's constant value, a Dropout's ratio). An error says what the CUDA device cannot run.
pub fn plan(l: &Launch, constant: &dyn Fn(&TensorRef) -> Option<HostTensor>) -> Result<LaunchPlan, String> {
    plan_with(l, constant, PlanOptions::default())
}

/// The switches of the device's options that change plans ([`crate::device::DeviceOptions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Kernels move 8 or 16 bytes of a tensor at a time where they can (element-wise chains and
    /// lone element-wise launches, batch norms, GELU's gradient, strided copies of whole rows);
    /// off: one element at a time. (The multi-tensor optimizer update chooses for itself, by its
    /// tensors' alignment.)
    pub wide: bool,
    /// A dense layer's ReLU keeps its signs as bits for its gradient's product
    /// ([`LtGemm::mask`]); off: the gradient is the GEMM and the ReluGrad kernel over the ReLU's
    /// output (cuBLASLt's other epilogues kept).
    pub relu_masks: bool,
    /// A lone element-wise launch may run as a one-step chain kernel (off with fusion).
    pub fuse: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions::from(&crate::device::DeviceOptions::default())
    }
}

impl From<&crate::device::DeviceOptions> for PlanOptions {
    fn from(o: &crate::device::DeviceOptions) -> Self {
        PlanOptions { wide: o.wide, relu_masks: o.relu_masks, fuse: o.fuse }
    }
}

/// [`plan`] under `opts`.
pub fn plan_with(
    l: &Launch,
    constant: &dyn Fn(&TensorRef) -> Option<HostTensor>,
    opts: PlanOptions,
) -> Result<LaunchPlan, String> {
    let mut p = Planner { l, opts, constant, out: LaunchPlan::default(), sibling_done: false };
    // Outputs with no elements need no kernel.
    let empty = |l: &Launch| !l.outputs.is_empty() && l.outputs.iter().all(|t| t.numel() == 0);
    if !empty(l) {
        plan_op(&mut p)?;
    }
    if let Some(s) = l.sibling.as_deref().filter(|s| !p.sibling_done && !empty(s)) {
        // The sibling's own calls, after the launch's.
        p.plan_sibling(s)?;
    }
    Ok(p.out)
}

/// The reduction a reducing launch computes: a Reduce op's ([`Op::reduction`]), or the global
/// pools' (a mean or a max over the spatial axes).
fn reduce_kind(op: &Op) -> Option<ReduceKind> {
    match op {
        Op::GlobalAveragePool => Some(ReduceKind::Mean),
        Op::GlobalMaxPool => Some(ReduceKind::Max),
        op => op.reduction().map(|(k, _)| k),
    }
}

/// A lone element-wise launch of many elements as a chain of one step, where its tensors let the
/// generated kernel take 8 or 4 elements at a time ([`fused::vector_width`]) and the hand-written
/// kernel would take one: the same functor, so the same bits (`MPC_FUSE=0` keeps the kernel).
fn lone_chain(l: &Launch, opts: PlanOptions) -> Option<crate::fuse::Chain> {
    use crate::fuse::{Chain, ChainArg, ChainStep};
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let [y] = l.outputs.as_slice() else { return None };
    let ins: Vec<&TensorRef> =
        l.inputs.iter().map(|o| if let Operand::Device(t) = o { Some(t) } else { None }).collect::<Option<_>>()?;
    let plain = l.epilogue.is_none()
        && l.epilogue_then.is_none()
        && l.relu_prologue.is_none()
        && l.sibling.is_none()
        && l.group.is_empty()
        && l.branches.is_none();
    if !plain
        || !opts.fuse
        || !opts.wide
        || !crate::fuse::fusable_op(&l.op)
        || (matches!(l.op, Op::Sum) && ins.len() != 2)
        // (A Cast to its own dtype is a copy of the bits; a chain would widen and round them.)
        || (matches!(l.op, Op::Cast(_)) && ins.iter().any(|t| t.dtype == y.dtype))
        || y.numel() < LONE_CHAIN_MIN
        || y.shape.len() > 8
        || !float(y.dtype)
        || !ins.iter().all(|t| float(t.dtype))
    {
        return None;
    }
    let n = y.numel() as u64;
    let whole: Vec<&TensorRef> = ins.iter().copied().filter(|t| fused::read_whole(t, n)).chain([y]).collect();
    if fused::vector_width(n, &whole, true) == 1 {
        return None;
    }
    let args = (0..ins.len()).map(ChainArg::Input).collect();
    let step = ChainStep { node: l.node.clone(), op: l.op.clone(), args, dtype: y.dtype };
    Some(Chain { steps: vec![step], outputs: vec![0] })
}

/// The block of a softmax's (or a fused chain's row-wise step's) launch over rows of `len`: one
/// warp per row up to 1024 elements (32 rows in flight per multiprocessor, each thread walking a
/// few dozen elements, reductions within the warp), 256 threads beyond. The sums' order follows
/// from it, so the unfused kernels and the fused chains take it from here alike.
pub(super) fn row_block(len: u64) -> u32 {
    if len <= 1024 {
        32
    } else {
        BLOCK
    }
}

/// The elements from which a lone element-wise launch is worth a generated kernel of its own.
const LONE_CHAIN_MIN: usize = 1 << 16;

fn plan_op(p: &mut Planner) -> Result<(), String> {
    // The epilogues the kernels apply: a layer norm's Cast (by its output's dtype), a batch
    // norm's Relu, or its residual Add and the Relu after it, a Gemm's Relu, ReluGrad or
    // GeluGrad, a MatMul's Transpose or bias.
    match (&p.l.op, &p.l.epilogue, &p.l.epilogue_then) {
        (_, None, None)
        | (Op::LayerNormalization(_), Some(Op::Cast(_)), None)
        | (Op::BatchNormalization(_) | Op::Gemm(_), Some(Op::Relu), None)
        | (Op::BatchNormalization(_), Some(Op::Add), None | Some(Op::Relu))
        | (Op::Gemm(_), Some(Op::ReluGrad | Op::GeluGrad(_)), None)
        | (Op::MatMul, Some(Op::Transpose(_) | Op::Add), None) => {}
        (op, Some(e), then) => {
            let then = then.as_ref().map_or(String::new(), |t| format!(" and a {}", t.op_type()));
            return Err(format!("{} with a {}{then} epilogue", op.op_type(), e.op_type()));
        }
        (op, None, Some(t)) => return Err(format!("{} with a {} after no epilogue", op.op_type(), t.op_type())),
    }
    // The operands the kernels read through a ReLU's gradient: a batch norm gradient's dy.
    if p.l.relu_prologue.is_some() && !matches!(p.l.op, Op::BatchNormalizationGrad(_)) {
        return Err(format!("{} reading its input through a ReluGrad", p.l.op.op_type()));
    }
    if !p.l.group.is_empty() {
        return train::plan_update_group(p);
    }
    if let Some(chain) = &p.l.chain {
        return fused::plan_chain(p, chain);
    }
    if let Some(chain) = lone_chain(p.l, p.opts) {
        return fused::plan_chain(p, &chain);
    }
    let op = &p.l.op;
    if plan_elementwise(p)? {
        return Ok(());
    }
    match op.kind() {
        Kind::MatMul => match op {
            Op::MatMul => plan_matmul(p)?,
            Op::Gemm(a) => plan_gemm(p, a)?,
            Op::Einsum(a) => plan_einsum(p, &a.equation)?,
            op => return Err(no_kernel(op)),
        },
        Kind::Reduce(_) => plan_reduce(p)?,
        Kind::Pool if matches!(op, Op::GlobalAveragePool | Op::GlobalMaxPool) => plan_reduce(p)?,
        Kind::Pool => plan_pool(p)?,
        Kind::RowWise => plan_row_wise(p)?,
        Kind::Norm => match op {
            Op::LRN(a) => plan_lrn(p, a)?,
            _ => plan_norm(p)?,
        },
        Kind::Attention => plan_attention(p)?,
        Kind::Conv => match op {
            Op::ConvTranspose(a) => plan_conv_transpose(p, a)?,
            _ => plan_conv(p)?,
        },
        Kind::Movement => plan_movement(p)?,
        Kind::Shape => plan_shape(p)?,
        Kind::Scan => plan_scan(p)?,
        Kind::Index => plan_index(p)?,
        Kind::Loss => plan_loss(p)?,
        Kind::Train | Kind::ActivationGrad => plan_train(p)?,
        Kind::Random if matches!(op, Op::SeededDropout(_)) => plan_train(p)?,
        _ => return Err(no_kernel(op)),
    }
    Ok(())
}

/// The error for an op the CUDA device has no kernel for.
fn no_kernel(op: &Op) -> String {
    format!("{} has no CUDA kernel yet", op.op_type())
}

/// `(prod(shape[..a]), prod(shape[a..b]), prod(shape[b..]))`.
fn split3(shape: &[usize], a: usize, b: usize) -> (u64, u64, u64) {
    (numel(&shape[..a]), numel(&shape[a..b]), numel(&shape[b..]))
}

/// The dtype the norm and loss kernels compute, keep statistics and sum in for `x`'s data: f64
/// for f64, else f32 (`AccT` in kernels/common.cuh).
fn acc_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn window3(w: &Window, inp: &[usize]) -> Result<Window3, String> {
    let sp = w.kernel.len();
    if sp == 0 || sp > 3 {
        return Err(format!("a window over {sp} spatial dims (the CUDA kernels take 1 to 3)"));
    }
    let fill = |v: &[usize]| {
        let mut a = [1i64; 3];
        v.iter().enumerate().for_each(|(i, &x)| a[i] = x as i64);
        a
    };
    let zeros = |v: &[usize]| {
        let mut a = [0i64; 3];
        v.iter().enumerate().for_each(|(i, &x)| a[i] = x as i64);
        a
    };
    Ok(Window3 {
        inp: fill(inp),
        out: fill(&w.out),
        k: fill(&w.kernel),
        stride: fill(&w.strides),
        dil: fill(&w.dilations),
        pad: zeros(&w.pads_begin),
        pad_end: zeros(&w.pads_end),
        nsp: sp as i32,
        unused: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lone_chain_default(l: &Launch) -> Option<crate::fuse::Chain> {
        lone_chain(l, PlanOptions::default())
    }

    #[test]
    fn broadcast_walks_are_coalesced() {
        // A bias row over (8, 512, 3072): two dims, the bias's outer stride 0.
        let out = [8, 512, 3072];
        let (a, b) = (contiguous(&out), us(&broadcast_strides(&[3072], &out)));
        assert_eq!(coalesce(&out, &[&a, &b]), (vec![4096, 3072], vec![vec![3072, 1], vec![0, 1]]));
        // A scalar: one dim, no division in the kernel.
        let s = us(&broadcast_strides(&[], &out));
        assert_eq!(coalesce(&out, &[&a, &s]), (vec![8 * 512 * 3072], vec![vec![1], vec![0]]));
        assert_eq!(strided_args(&out, [&a, &s]).unwrap().0, 1);
        // Size-1 dims go; contiguous operands need no walk at all.
        assert_eq!(strided_args(&[1, 6, 1, 5], [&contiguous(&[1, 6, 1, 5]); 2]).unwrap().0, 0);
        // A transpose keeps its dims: (2, 3, 4) read as (0, 2, 1) of a (2, 4, 3) tensor.
        let (x, y) = ([12, 1, 3], contiguous(&[2, 3, 4]));
        assert_eq!(coalesce(&[2, 3, 4], &[&x, &y]), (vec![2, 3, 4], vec![vec![12, 1, 3], vec![12, 4, 1]]));
        // A slice of the inner dim stops the merge only there.
        let (x, y) = ([40, 10, 1], contiguous(&[2, 4, 5]));
        assert_eq!(coalesce(&[2, 4, 5], &[&x, &y]), (vec![8, 5], vec![vec![10, 1], vec![5, 1]]));
    }

    /// A lone element-wise launch is a generated kernel only where it can take several elements
    /// at a time; an input that differs from the output in dims of 1 only is read whole, its
    /// start counts as the output's does.
    #[test]
    fn lone_launches_are_chains_where_every_whole_tensor_allows_wide_accesses() {
        let t = |offset: u64, shape: &[usize]| TensorRef {
            region: Region::Arena,
            offset,
            dtype: DType::F16,
            shape: shape.to_vec(),
        };
        let add = |a: TensorRef, b: TensorRef| {
            Launch::new("a", Op::Add, vec![Operand::Device(a), Operand::Device(b)], vec![t(1 << 20, &[1, 64, 2048])])
        };
        assert!(lone_chain_default(&add(t(0, &[64, 2048]), t(1 << 19, &[1, 64, 2048]))).is_some());
        // A bias row is broadcast, read one element at a time wherever it starts.
        assert!(lone_chain_default(&add(t(0, &[64, 2048]), t(2, &[2048]))).is_some());
        // Read whole, but 2 bytes off a 16- or 8-byte boundary: every access one element.
        assert!(lone_chain_default(&add(t(2, &[64, 2048]), t(1 << 19, &[1, 64, 2048]))).is_none());
        assert!(lone_chain_default(&add(t(0, &[64, 2048]), t(2, &[1, 64, 2048]))).is_none());
    }
}
