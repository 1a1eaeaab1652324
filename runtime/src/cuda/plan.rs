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
use mpc_ir::ops::{GeluApprox, PadMode, Reduction};
use mpc_ir::{normalize_axis, DType, Op};

use crate::program::{Launch, Operand, Region, TensorRef};
use crate::value::HostTensor;

/// A buffer as the plan names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// A byte offset in one of the program's regions.
    Tensor(Region, u64),
    /// A byte offset in the launch's workspace (scratch shared by all launches of a program).
    Work(u64),
    /// A byte offset in the launch's `aux` bytes, uploaded once.
    Aux(u64),
    /// The launch's error word (an i32 the device zeroes once and reads at each synchronisation):
    /// kernels that read indices from device memory store 1 there for one out of range.
    Flag,
}

impl Buf {
    /// The same buffer `bytes` further on.
    pub fn at(self, bytes: u64) -> Buf {
        match self {
            Buf::Tensor(r, o) => Buf::Tensor(r, o + bytes),
            Buf::Work(o) => Buf::Work(o + bytes),
            Buf::Aux(o) => Buf::Aux(o + bytes),
            Buf::Flag => Buf::Flag,
        }
    }
}

/// One kernel argument, passed by value as the kernel declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(Buf),
    Null,
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
    U64(u64),
    /// `Dims8` or `Strides8` (common.cuh): 8 × i64.
    Dims([i64; 8]),
    /// `Window3` (common.cuh).
    Window(Window3),
}

/// `struct Window3` of kernels/common.cuh, byte for byte.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Window3 {
    pub inp: [i64; 3],
    pub out: [i64; 3],
    pub k: [i64; 3],
    pub stride: [i64; 3],
    pub dil: [i64; 3],
    pub pad: [i64; 3],
    pub pad_end: [i64; 3],
    pub nsp: i32,
    pub unused: i32,
}

impl Window3 {
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(176);
        for a in [self.inp, self.out, self.k, self.stride, self.dil, self.pad, self.pad_end] {
            a.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
        out.extend_from_slice(&self.nsp.to_le_bytes());
        out.extend_from_slice(&self.unused.to_le_bytes());
        out
    }
}

impl Arg {
    /// Size and alignment in bytes, as C lays the parameter out.
    pub fn layout(&self) -> (usize, usize) {
        match self {
            Arg::I32(_) | Arg::F32(_) => (4, 4),
            Arg::Dims(_) => (64, 8),
            Arg::Window(_) => (176, 8),
            _ => (8, 8),
        }
    }

    /// The argument's bytes, with `ptr` resolving the buffers it names.
    pub fn bytes(&self, ptr: &dyn Fn(Buf) -> u64) -> Vec<u8> {
        match *self {
            Arg::Ptr(b) => ptr(b).to_le_bytes().to_vec(),
            Arg::Null => 0u64.to_le_bytes().to_vec(),
            Arg::I64(v) => v.to_le_bytes().to_vec(),
            Arg::I32(v) => v.to_le_bytes().to_vec(),
            Arg::F32(v) => v.to_le_bytes().to_vec(),
            Arg::F64(v) => v.to_le_bytes().to_vec(),
            Arg::U64(v) => v.to_le_bytes().to_vec(),
            Arg::Dims(d) => d.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Arg::Window(w) => w.bytes(),
        }
    }
}

/// The byte offset of each argument in a kernel's parameter buffer, and the buffer's size.
pub fn param_offsets(args: &[Arg]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(args.len());
    let mut at = 0usize;
    for a in args {
        let (size, align) = a.layout();
        at = at.next_multiple_of(align);
        offsets.push(at);
        at += size;
    }
    (offsets, at)
}

/// Whether `args` are what `kernel` declares (its parameters' offsets and sizes, read from the
/// cubin by [`super::cubin`]).
pub fn check_args(name: &str, args: &[Arg], declared: &super::cubin::KernelParams) -> Result<(), String> {
    let (offsets, total) = param_offsets(args);
    let got: Vec<(u32, u32)> = offsets.iter().zip(args).map(|(&o, a)| (o as u32, a.layout().0 as u32)).collect();
    let want: Vec<(u32, u32)> = declared.params.iter().map(|q| (q.offset, q.size)).collect();
    if got != want || total as u32 != declared.total {
        return Err(format!(
            "{name} takes (offset, size) {want:?} ({} bytes); the plan passes {got:?} ({total} bytes)",
            declared.total
        ));
    }
    Ok(())
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The family (`kernels/<family>.cu`) and the kernel's name in it.
    pub family: &'static str,
    pub name: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub args: Vec<Arg>,
}

/// A cuBLAS strided-batched GEMM in cuBLAS's column-major terms: `C = alpha op(A) op(B) + beta C`
/// for each of `batch` matrices, FP32 accumulation for f32/f16/bf16, f64 for f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    /// The operands' dtype, and the result's (f32 for a low-precision product whose result is
    /// summed further before it is rounded).
    pub dtype: DType,
    pub c_dtype: DType,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub alpha: f64,
    pub beta: f64,
    pub a: Buf,
    pub lda: i64,
    pub stride_a: i64,
    pub b: Buf,
    pub ldb: i64,
    pub stride_b: i64,
    pub c: Buf,
    pub ldc: i64,
    pub stride_c: i64,
    pub batch: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    Kernel(Kernel),
    Gemm(Gemm),
    /// A device-to-device copy.
    Copy {
        from: Buf,
        to: Buf,
        bytes: u64,
    },
    /// Every byte of the range set to `byte`.
    Fill {
        to: Buf,
        bytes: u64,
        byte: u8,
    },
}

/// Everything one launch enqueues.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchPlan {
    pub calls: Vec<Call>,
    /// Scratch bytes the calls use (256-byte aligned pieces).
    pub workspace: u64,
    /// Bytes to upload once; [`Buf::Aux`] offsets point into them.
    pub aux: Vec<u8>,
    /// Device addresses a kernel reads from `aux` (a multi-tensor launch's pointer array): the
    /// 8 bytes at each offset become the address of the buffer, once it is known.
    pub addresses: Vec<(u64, Buf)>,
}

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

/// The same walk over fewer dims: dims of size 1 dropped, and each dim merged into the next where
/// every operand steps over the two as over one (`s[d] == s[d + 1] * dims[d + 1]`). The kernels
/// divide an element's linear index once per dim: a bias row or a scalar broadcast over any
/// shape becomes one or two dims. Returns the dims and each operand's strides over them.
fn coalesce(dims: &[usize], strides: &[&[i64]]) -> (Vec<i64>, Vec<Vec<i64>>) {
    let mut out: Vec<i64> = Vec::with_capacity(dims.len());
    let mut outs: Vec<Vec<i64>> = vec![Vec::with_capacity(dims.len()); strides.len()];
    for (d, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let n = n as i64;
        let merge = !out.is_empty() && strides.iter().zip(&outs).all(|(s, o)| o[o.len() - 1] == s[d] * n);
        if merge {
            *out.last_mut().expect("a dim") *= n;
            for (s, o) in strides.iter().zip(outs.iter_mut()) {
                *o.last_mut().expect("a stride") = s[d];
            }
        } else {
            out.push(n);
            for (s, o) in strides.iter().zip(outs.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    (out, outs)
}

/// The rank and the dims and strides arguments of a strided kernel over `dims` (coalesced), for
/// each operand's strides; rank 0 where every operand is contiguous over the whole walk.
fn strided_args<const K: usize>(
    dims: &[usize],
    strides: [&[i64]; K],
) -> Result<(i32, [i64; 8], [[i64; 8]; K]), String> {
    let (d, s) = coalesce(dims, &strides);
    if d.len() <= 1 && s.iter().all(|s| s.iter().all(|&x| x == 1)) {
        return Ok((0, [0; 8], [[0; 8]; K]));
    }
    let mut out = [[0i64; 8]; K];
    for (o, s) in out.iter_mut().zip(&s) {
        *o = dims8(s)?;
    }
    Ok((d.len() as i32, dims8(&d)?, out))
}

fn dims8(v: &[i64]) -> Result<[i64; 8], String> {
    if v.len() > 8 {
        return Err(format!("rank {} (the CUDA kernels take at most 8 dims)", v.len()));
    }
    let mut d = [0i64; 8];
    d[..v.len()].copy_from_slice(v);
    Ok(d)
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
    constant: &'a dyn Fn(&TensorRef) -> Option<HostTensor>,
    out: LaunchPlan,
}

fn buf(t: &TensorRef) -> Buf {
    Buf::Tensor(t.region, t.offset)
}

impl<'a> Planner<'a> {
    fn input(&self, i: usize) -> Result<&'a TensorRef, String> {
        match self.l.inputs.get(i) {
            Some(Operand::Device(t)) => Ok(t),
            Some(Operand::Host(_)) => Err(format!("input {i} is a value known when lowering, not a device tensor")),
            _ => Err(format!("input {i} is missing")),
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
        self.out.calls.push(Call::Kernel(Kernel { family, name, grid, block, args }));
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

    /// `y[c] = x[Σ c_d xs_d]` over `dims`, y at `ys` strides (movement_copy).
    fn strided_copy(
        &mut self,
        dtype: DType,
        x: Buf,
        y: Buf,
        dims: &[usize],
        xs: &[i64],
        ys: &[i64],
    ) -> Result<(), String> {
        let n = numel(dims);
        let name = format!("movement_copy_{}", size_tag(dtype)?);
        let (rank, d, [xs, ys]) = strided_args(dims, [xs, ys])?;
        let args = vec![
            Arg::Ptr(x),
            Arg::Ptr(y),
            Arg::I64(n as i64),
            Arg::I32(rank),
            Arg::Dims(d),
            Arg::Dims(xs),
            Arg::Dims(ys),
        ];
        self.flat("movement", name, n, args);
        Ok(())
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

    fn gemm(&mut self, g: Gemm) {
        if g.m > 0 && g.n > 0 && g.batch > 0 {
            self.out.calls.push(Call::Gemm(g));
        }
    }
}

/// Plans one launch; `constant` gives the value of a tensor of the program's constants region
/// (a Pad's constant value, a Dropout's ratio). An error says what the CUDA device cannot run.
pub fn plan(l: &Launch, constant: &dyn Fn(&TensorRef) -> Option<HostTensor>) -> Result<LaunchPlan, String> {
    let mut p = Planner { l, constant, out: LaunchPlan::default() };
    // Outputs with no elements need no kernel.
    if !l.outputs.is_empty() && l.outputs.iter().all(|t| t.numel() == 0) {
        return Ok(p.out);
    }
    plan_op(&mut p)?;
    Ok(p.out)
}

fn unary_name(op: &Op) -> Option<(&'static str, f32, f32)> {
    Some(match op {
        Op::Relu => ("relu", 0.0, 0.0),
        Op::Sigmoid => ("sigmoid", 0.0, 0.0),
        Op::Tanh => ("tanh", 0.0, 0.0),
        Op::Exp => ("exp", 0.0, 0.0),
        Op::Log => ("log", 0.0, 0.0),
        Op::Sqrt => ("sqrt", 0.0, 0.0),
        Op::Neg => ("neg", 0.0, 0.0),
        Op::Abs => ("abs", 0.0, 0.0),
        Op::Erf => ("erf", 0.0, 0.0),
        Op::Reciprocal => ("reciprocal", 0.0, 0.0),
        Op::Floor => ("floor", 0.0, 0.0),
        Op::Ceil => ("ceil", 0.0, 0.0),
        Op::Round => ("round", 0.0, 0.0),
        Op::Sign => ("sign", 0.0, 0.0),
        Op::Sin => ("sin", 0.0, 0.0),
        Op::Cos => ("cos", 0.0, 0.0),
        Op::Softplus => ("softplus", 0.0, 0.0),
        Op::Softsign => ("softsign", 0.0, 0.0),
        Op::HardSwish => ("hard_swish", 0.0, 0.0),
        Op::Gelu(a) if a.approximate == GeluApprox::Tanh => ("gelu_tanh", 0.0, 0.0),
        Op::Gelu(_) => ("gelu", 0.0, 0.0),
        Op::LeakyRelu(a) => ("leaky_relu", a.alpha, 0.0),
        Op::Elu(a) => ("elu", a.alpha, 0.0),
        Op::Selu(a) => ("selu", a.alpha, a.gamma),
        Op::HardSigmoid(a) => ("hard_sigmoid", a.alpha, a.beta),
        Op::Opaque(o) if o.domain == "com.microsoft" && o.op_type == "Gelu" => ("gelu", 0.0, 0.0),
        _ => return None,
    })
}

fn binary_name(op: &Op) -> Option<&'static str> {
    Some(match op {
        Op::Add | Op::Sum | Op::Mean => "add",
        Op::Sub => "sub",
        Op::Mul => "mul",
        Op::Div => "div",
        Op::Pow => "pow",
        Op::Min => "min",
        Op::Max => "max",
        Op::PRelu => "prelu",
        Op::Mod(a) if a.fmod => "mod",
        Op::Mod(_) => "mod_py",
        Op::Equal => "equal",
        Op::Less => "less",
        Op::Greater => "greater",
        Op::GreaterOrEqual => "greater_equal",
        Op::LessOrEqual => "less_equal",
        Op::And => "and",
        Op::Or => "or",
        Op::Xor => "xor",
        _ => return None,
    })
}

fn reduce_kind(op: &Op) -> Option<&'static str> {
    Some(match op {
        Op::ReduceSum(_) => "sum",
        Op::ReduceMean(_) | Op::GlobalAveragePool => "mean",
        Op::ReduceMax(_) | Op::GlobalMaxPool => "max",
        Op::ReduceMin(_) => "min",
        Op::ReduceProd(_) => "prod",
        Op::ReduceSumSquare(_) => "sum_square",
        Op::ReduceL1(_) => "l1",
        Op::ReduceL2(_) => "l2",
        Op::ReduceLogSumExp(_) => "log_sum_exp",
        _ => return None,
    })
}

fn plan_op(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    if let Some((name, alpha, beta)) = unary_name(op) {
        let (x, y) = (p.input(0)?, p.output(0)?);
        let n = x.numel() as u64;
        if x.dtype.is_float() {
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64), Arg::F32(alpha), Arg::F32(beta)];
            p.flat("elementwise", format!("elementwise_{name}_{}", float_tag(x.dtype)?), n, args);
        } else if matches!(op, Op::Neg | Op::Abs | Op::Relu | Op::Sign) && matches!(x.dtype, DType::I64 | DType::I32) {
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
            p.flat("elementwise", format!("elementwise_{name}_{}", tag(x.dtype)?), n, args);
        } else {
            return Err(format!("{} on {}", op.op_type(), x.dtype));
        }
        return Ok(());
    }
    match op {
        Op::Identity => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.copy(buf(x), buf(y), y.bytes());
        }
        Op::Dropout(_) => {
            if p.host_ints(2).is_some_and(|v| v.first() == Some(&1)) {
                return Err("Dropout in training mode".into());
            }
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.copy(buf(x), buf(y), y.bytes());
            if let Some(mask) = p.l.outputs.get(1) {
                p.out.calls.push(Call::Fill { to: buf(mask), bytes: mask.bytes(), byte: 1 });
            }
        }
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Pow | Op::PRelu | Op::Mod(_) => {
            let (a, b, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let name = binary_name(op).expect("a binary op");
            let t = if a.dtype.is_float() { float_tag(a.dtype)? } else { tag(a.dtype)? };
            let mut bb = buf(b);
            if b.dtype != a.dtype {
                // Pow's exponent takes the base's dtype first.
                if !matches!(op, Op::Pow) {
                    return Err(format!("{} of {} and {}", op.op_type(), a.dtype, b.dtype));
                }
                let w = p.work(b.numel() as u64 * a.dtype.size() as u64);
                p.cast(b.dtype, a.dtype, bb, w, b.numel() as u64)?;
                bb = w;
            }
            p.binary(name, t, (buf(a), &a.shape), (bb, &b.shape), buf(y), &y.shape)?;
        }
        Op::Sum | Op::Max | Op::Min | Op::Mean => {
            let y = p.output(0)?;
            let ins: Vec<&TensorRef> = (0..p.l.inputs.len()).map(|i| p.input(i)).collect::<Result<_, _>>()?;
            let name = binary_name(op).expect("a variadic op");
            let t = if y.dtype.is_float() { float_tag(y.dtype)? } else { tag(y.dtype)? };
            let mean = matches!(op, Op::Mean);
            if ins.len() == 1 && !mean {
                p.copy(buf(ins[0]), buf(y), y.bytes());
                return Ok(());
            }
            // Left to right, as the CPU reference: each partial result in its own broadcast shape.
            let (mut acc, mut shape) = (buf(ins[0]), ins[0].shape.clone());
            for (i, x) in ins.iter().enumerate().skip(1) {
                let out = mpc_ir::geometry::broadcast_shape(&[&shape, &x.shape]).ok_or("inputs do not broadcast")?;
                let last = i == ins.len() - 1 && !mean;
                let dst = if last { buf(y) } else { p.work(numel(&out) * y.dtype.size() as u64) };
                p.binary(name, t, (acc, &shape), (buf(x), &x.shape), dst, &out)?;
                (acc, shape) = (dst, out);
            }
            if mean {
                let n = p.aux(&scalar_bytes(y.dtype, ins.len() as f64));
                p.binary("div", t, (acc, &shape), (n, &[]), buf(y), &y.shape)?;
            }
        }
        Op::Equal | Op::Less | Op::Greater | Op::GreaterOrEqual | Op::LessOrEqual | Op::And | Op::Or | Op::Xor => {
            let (a, b, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            if a.dtype != b.dtype {
                return Err(format!("{} of {} and {}", op.op_type(), a.dtype, b.dtype));
            }
            let name = binary_name(op).expect("a comparison");
            p.binary(name, tag(a.dtype)?, (buf(a), &a.shape), (buf(b), &b.shape), buf(y), &y.shape)?;
        }
        Op::Not => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            p.flat(
                "elementwise",
                "elementwise_not_u8".into(),
                n,
                vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)],
            );
        }
        Op::Where => {
            let (c, a, b, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
            let n = y.numel() as u64;
            let out = &y.shape;
            let same = c.shape == *out && a.shape == *out && b.shape == *out;
            let st = |s: &[usize]| us(&broadcast_strides(s, out));
            let (rank, dims, [sc, sa, sb]) = if same {
                (0, [0; 8], [[0; 8]; 3])
            } else {
                strided_args(out, [&st(&c.shape), &st(&a.shape), &st(&b.shape)])?
            };
            let args = vec![
                Arg::Ptr(buf(c)),
                Arg::Ptr(buf(a)),
                Arg::Ptr(buf(b)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I32(rank),
                Arg::Dims(dims),
                Arg::Dims(sc),
                Arg::Dims(sa),
                Arg::Dims(sb),
            ];
            p.flat("elementwise", format!("elementwise_where_{}", size_tag(y.dtype)?), n, args);
        }
        Op::Clip => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            let bound = |i: usize| p.opt_input(i).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let (lo, hi) = (bound(1), bound(2));
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64), lo, hi];
            p.flat("elementwise", format!("elementwise_clip_{}", tag(x.dtype)?), n, args);
        }
        Op::IsNaN | Op::IsInf(_) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = x.numel() as u64;
            let t = float_tag(x.dtype)?;
            let mut args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
            let name = if let Op::IsInf(a) = op {
                args.extend([Arg::I32(a.detect_positive as i32), Arg::I32(a.detect_negative as i32)]);
                "isinf"
            } else {
                "isnan"
            };
            p.flat("elementwise", format!("elementwise_{name}_{t}"), n, args);
        }
        Op::Cast(_) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.cast(x.dtype, y.dtype, buf(x), buf(y), x.numel() as u64)?;
        }
        Op::MatMul => plan_matmul(p)?,
        Op::Gemm(a) => {
            let (x, w, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            if x.shape.len() != 2 || w.shape.len() != 2 {
                return Err("Gemm of operands that are not matrices".into());
            }
            let (m, n) = (y.shape[0] as i64, y.shape[1] as i64);
            let k = if a.transA { x.shape[0] } else { x.shape[1] } as i64;
            let beta = match p.opt_input(2) {
                Some(c) if a.beta != 0.0 => {
                    p.expand(y.dtype, buf(c), &c.shape, buf(y), &y.shape)?;
                    a.beta as f64
                }
                _ => 0.0,
            };
            // Row-major Y = op(X) op(W) is column-major Yᵀ = op(W)ᵀ op(X)ᵀ.
            p.gemm(Gemm {
                dtype: y.dtype,
                c_dtype: y.dtype,
                trans_a: a.transB,
                trans_b: a.transA,
                m: n,
                n: m,
                k,
                alpha: a.alpha as f64,
                beta,
                a: buf(w),
                lda: if a.transB { k } else { n },
                stride_a: 0,
                b: buf(x),
                ldb: if a.transA { m } else { k },
                stride_b: 0,
                c: buf(y),
                ldc: n,
                stride_c: 0,
                batch: 1,
            });
        }
        Op::ReduceSum(_)
        | Op::ReduceMean(_)
        | Op::ReduceMax(_)
        | Op::ReduceMin(_)
        | Op::ReduceSumSquare(_)
        | Op::ReduceL2(_)
        | Op::ReduceLogSumExp(_)
        | Op::ReduceL1(_)
        | Op::ReduceProd(_)
        | Op::GlobalAveragePool
        | Op::GlobalMaxPool => plan_reduce(p)?,
        Op::ArgMax(a) | Op::ArgMin(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, len, inner) = split3(&x.shape, ax, ax + 1);
            let kind = if matches!(op, Op::ArgMin(_)) { "argmin" } else { "argmax" };
            let t = float_tag(x.dtype)?;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(len as i64),
                Arg::I64(inner as i64),
                Arg::I32(a.select_last_index as i32),
            ];
            if inner == 1 {
                p.kernel("reduce", format!("reduce_{kind}_rows_{t}"), rows_grid(outer), [BLOCK, 1, 1], args);
            } else {
                let grid = [inner.div_ceil(32) as u32, outer.clamp(1, MAX_ROWS) as u32, 1];
                p.kernel("reduce", format!("reduce_{kind}_cols_{t}"), grid, [32, 8, 1], args);
            }
        }
        Op::Softmax(_) | Op::LogSoftmax(_) | Op::SoftmaxGrad(_) => {
            let a = match op {
                Op::Softmax(a) | Op::LogSoftmax(a) => a,
                Op::SoftmaxGrad(a) => &**a,
                _ => unreachable!(),
            };
            let grad = matches!(op, Op::SoftmaxGrad(_));
            let x = p.input(if grad { 1 } else { 0 })?;
            let y = p.output(0)?;
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
            let name = match op {
                Op::Softmax(_) => "softmax",
                Op::LogSoftmax(_) => "log_softmax",
                _ => "softmax_grad",
            };
            let mut args = vec![Arg::Ptr(buf(x))];
            if grad {
                args.insert(0, Arg::Ptr(buf(p.input(0)?)));
            }
            args.extend([Arg::Ptr(buf(y)), Arg::I64(outer as i64), Arg::I64(n as i64), Arg::I64(inner as i64)]);
            let block = if n <= 128 { 32 } else { BLOCK };
            let t = float_tag(x.dtype)?;
            p.kernel("softmax", format!("softmax_{name}_{t}"), rows_grid(outer * inner), [block, 1, 1], args);
        }
        Op::LayerNormalization(_)
        | Op::LayerNormalizationGrad(_)
        | Op::BatchNormalization(_)
        | Op::BatchNormalizationGrad(_)
        | Op::InstanceNormalization(_)
        | Op::GroupNormalization(_) => plan_norm(p)?,
        Op::MaxPool(_) | Op::AveragePool(_) | Op::MaxPoolGrad(_) | Op::AveragePoolGrad(_) => plan_pool(p)?,
        Op::Conv(_) | Op::ConvGrad(_) => plan_conv(p)?,
        Op::ConvTranspose(a) => plan_conv_transpose(p, a)?,
        Op::LRN(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            if x.shape.len() < 2 {
                return Err("LRN of a tensor of rank below 2".into());
            }
            let (n, c) = (x.numel() as u64, x.shape[1] as i64);
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I64(c),
                Arg::I64(numel(&x.shape[2..]) as i64),
                Arg::I64(a.size),
                Arg::F32(a.alpha),
                Arg::F32(a.beta),
                Arg::F32(a.bias),
            ];
            p.flat("norm", format!("norm_lrn_{}", float_tag(x.dtype)?), n, args);
        }
        Op::Transpose(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let r = x.shape.len();
            let perm: Vec<usize> = match &a.perm {
                Some(v) => {
                    v.iter().map(|&d| normalize_axis(d, r).ok_or("perm out of range")).collect::<Result<_, _>>()?
                }
                None => (0..r).rev().collect(),
            };
            let xs = contiguous(&x.shape);
            let xs: Vec<i64> = perm.iter().map(|&d| xs[d]).collect();
            p.strided_copy(x.dtype, buf(x), buf(y), &y.shape, &xs, &contiguous(&y.shape))?;
        }
        Op::Expand => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.expand(x.dtype, buf(x), &x.shape, buf(y), &y.shape)?;
        }
        Op::Slice => plan_slice(p)?,
        Op::Concat(a) => {
            let y = p.output(0)?;
            let ax = normalize_axis(a.axis, y.shape.len()).ok_or("axis out of range")?;
            let ys = contiguous(&y.shape);
            let mut at = 0u64;
            for i in 0..p.l.inputs.len() {
                let Some(x) = p.opt_input(i) else { continue };
                let to = buf(y).at(at * ys[ax] as u64 * y.dtype.size() as u64);
                p.strided_copy(x.dtype, buf(x), to, &x.shape, &contiguous(&x.shape), &ys)?;
                at += x.shape[ax] as u64;
            }
        }
        Op::Split(a) => {
            let x = p.input(0)?;
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let xs = contiguous(&x.shape);
            let mut at = 0u64;
            for y in &p.l.outputs {
                let from = buf(x).at(at * xs[ax] as u64 * x.dtype.size() as u64);
                p.strided_copy(x.dtype, from, buf(y), &y.shape, &xs, &contiguous(&y.shape))?;
                at += y.shape[ax] as u64;
            }
        }
        Op::Tile => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = y.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I32(y.shape.len() as i32),
                Arg::Dims(dims8(&us(&y.shape))?),
                Arg::Dims(dims8(&us(&x.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
            ];
            p.flat("movement", format!("movement_tile_{}", size_tag(x.dtype)?), n, args);
        }
        Op::Pad(a) => plan_pad(p, a.mode)?,
        Op::Trilu(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let k = p.host_ints(1).and_then(|v| v.first().copied()).unwrap_or(0);
            let r = x.shape.len();
            if r < 2 {
                return Err("Trilu of a tensor of rank below 2".into());
            }
            let n = x.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I64(x.shape[r - 2] as i64),
                Arg::I64(x.shape[r - 1] as i64),
                Arg::I64(k),
                Arg::I32(a.upper as i32),
            ];
            p.flat("movement", format!("movement_trilu_{}", size_tag(x.dtype)?), n, args);
        }
        Op::ConstantOfShape(a) => {
            let y = p.output(0)?;
            let v = a
                .value
                .as_ref()
                .map(HostTensor::from)
                .unwrap_or_else(|| HostTensor::from_f64(y.dtype, vec![1], vec![0.0]));
            let mut bits = [0u8; 8];
            v.write_le_bytes(&mut bits[..v.bytes().min(8)]);
            let n = y.numel() as u64;
            let args = vec![Arg::Ptr(buf(y)), Arg::I64(n as i64), Arg::U64(u64::from_le_bytes(bits))];
            p.flat("movement", format!("movement_fill_{}", size_tag(y.dtype)?), n, args);
        }
        Op::Range => {
            let y = p.output(0)?;
            let value =
                |p: &Planner, i: usize| p.host(i).cloned().ok_or_else(|| format!("Range's input {i} is not known"));
            let (start, delta) = (value(p, 0)?, value(p, 2)?);
            let bytes = |t: &HostTensor| {
                let mut b = vec![0u8; t.bytes()];
                t.write_le_bytes(&mut b);
                b
            };
            let (s, d) = (p.aux(&bytes(&start)), p.aux(&bytes(&delta)));
            let n = y.numel() as u64;
            let args = vec![Arg::Ptr(s), Arg::Ptr(d), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
            p.flat("movement", format!("movement_range_{}", tag(y.dtype)?), n, args);
        }
        Op::CumSum(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let ax = p.host_ints(1).and_then(|v| v.first().copied()).ok_or("CumSum's axis is not known")?;
            let ax = normalize_axis(ax, x.shape.len()).ok_or("axis out of range")?;
            let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(n as i64),
                Arg::I64(inner as i64),
                Arg::I32(a.exclusive as i32),
                Arg::I32(a.reverse as i32),
            ];
            p.flat("movement", format!("movement_cumsum_{}", tag(x.dtype)?), outer * inner, args);
        }
        Op::Gather(a) => {
            let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, len, inner) = split3(&x.shape, ax, ax + 1);
            let count = idx.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(idx)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(len as i64),
                Arg::I64(count as i64),
                Arg::I64(inner as i64),
                Arg::Ptr(Buf::Flag),
            ];
            let name = format!("gather_axis_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
            p.flat("gather", name, y.numel() as u64, args);
        }
        Op::GatherElements(a) => {
            let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let n = y.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(idx)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I32(idx.shape.len() as i32),
                Arg::Dims(dims8(&us(&idx.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
                Arg::I32(ax as i32),
                Arg::I64(x.shape[ax] as i64),
                Arg::Ptr(Buf::Flag),
            ];
            let name = format!("gather_elements_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
            p.flat("gather", name, n, args);
        }
        Op::GatherGrad(a) => plan_gather_grad(p, a.axis)?,
        Op::GatherND(a) => plan_gather_nd(p, a.batch_dims)?,
        Op::ScatterND(a) => plan_scatter(p, None, a.reduction)?,
        Op::ScatterElements(a) => plan_scatter(p, Some(a.axis), a.reduction)?,
        Op::Resize(a) => plan_resize(p, a)?,
        Op::Einsum(a) => plan_einsum(p, &a.equation)?,
        Op::SoftmaxCrossEntropyLoss(_)
        | Op::NegativeLogLikelihoodLoss(_)
        | Op::SoftmaxCrossEntropyLossGrad(_)
        | Op::NegativeLogLikelihoodLossGrad(_) => plan_loss(p)?,
        Op::AllFinite
        | Op::SgdUpdate(_)
        | Op::AdamUpdate(_)
        | Op::LossScaleUpdate(_)
        | Op::SeededDropout(_)
        | Op::ReluGrad
        | Op::GeluGrad(_) => plan_train(p)?,
        op => return Err(format!("{} has no CUDA kernel yet", op.op_type())),
    }
    Ok(())
}

/// `(prod(shape[..a]), prod(shape[a..b]), prod(shape[b..]))`.
fn split3(shape: &[usize], a: usize, b: usize) -> (u64, u64, u64) {
    (numel(&shape[..a]), numel(&shape[a..b]), numel(&shape[b..]))
}

fn plan_matmul(p: &mut Planner) -> Result<(), String> {
    let (a, b, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    // 1-D operands: a row vector on the left, a column vector on the right.
    let sa: Vec<usize> = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.clone() };
    let sb: Vec<usize> = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.clone() };
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    if sb[rb - 2] != k {
        return Err("MatMul operands whose inner dims differ".into());
    }
    let batch_shape =
        mpc_ir::geometry::broadcast_shape(&[&sa[..ra - 2], &sb[..rb - 2]]).ok_or("batch dims do not broadcast")?;
    let batch = numel(&batch_shape);
    // An operand's batch stride: its own when its batch dims are the output's, 0 when it has one
    // matrix, else it is expanded to the output's batch dims first.
    let operand =
        |p: &mut Planner, t: &TensorRef, s: &[usize], rows: usize, cols: usize| -> Result<(Buf, i64), String> {
            let own = &s[..s.len() - 2];
            let mat = (rows * cols) as i64;
            if numel(own) == 1 {
                Ok((buf(t), 0))
            } else if own == batch_shape.as_slice() {
                Ok((buf(t), mat))
            } else {
                let mut full = batch_shape.clone();
                full.extend([rows, cols]);
                let w = p.work(numel(&full) * t.dtype.size() as u64);
                p.expand(t.dtype, buf(t), s, w, &full)?;
                Ok((w, mat))
            }
        };
    let (pa, stride_a) = operand(p, a, &sa, m, k)?;
    let (pb, stride_b) = operand(p, b, &sb, k, n)?;
    // Row-major Y = A B is column-major Yᵀ = Bᵀ Aᵀ.
    p.gemm(Gemm {
        dtype: y.dtype,
        c_dtype: y.dtype,
        trans_a: false,
        trans_b: false,
        m: n as i64,
        n: m as i64,
        k: k as i64,
        alpha: 1.0,
        beta: 0.0,
        a: pb,
        lda: n as i64,
        stride_a: stride_b,
        b: pa,
        ldb: k as i64,
        stride_b: stride_a,
        c: buf(y),
        ldc: n as i64,
        stride_c: (m * n) as i64,
        batch: batch as i64,
    });
    if k == 0 {
        // An empty inner dim: the product is zeros.
        p.out.calls.retain(|c| !matches!(c, Call::Gemm(_)));
        p.out.calls.push(Call::Fill { to: buf(y), bytes: y.bytes(), byte: 0 });
    }
    Ok(())
}

fn plan_reduce(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (x, y) = (p.input(0)?, p.output(0)?);
    let kind = reduce_kind(&op).expect("a reduction");
    let r = x.shape.len();
    let axes: Vec<usize> = match &op {
        Op::GlobalAveragePool | Op::GlobalMaxPool => (2..r).collect(),
        Op::ReduceSum(a)
        | Op::ReduceMean(a)
        | Op::ReduceMax(a)
        | Op::ReduceMin(a)
        | Op::ReduceSumSquare(a)
        | Op::ReduceL2(a)
        | Op::ReduceLogSumExp(a)
        | Op::ReduceL1(a)
        | Op::ReduceProd(a) => match p.host_ints(1) {
            Some(v) if !v.is_empty() => {
                let mut v = v
                    .iter()
                    .map(|&d| normalize_axis(d, r).ok_or("axis out of range"))
                    .collect::<Result<Vec<_>, _>>()?;
                v.sort_unstable();
                v
            }
            _ if a.noop_with_empty_axes => {
                p.copy(buf(x), buf(y), y.bytes());
                return Ok(());
            }
            _ => (0..r).collect(),
        },
        _ => unreachable!("not a reduction"),
    };
    let t = if x.dtype.is_float() {
        float_tag(x.dtype)?
    } else if matches!(kind, "sum" | "max" | "min" | "prod") {
        tag(x.dtype)?
    } else {
        return Err(format!("{} on {}", op.op_type(), x.dtype));
    };
    // The reduced dims must be one block of the dims that are not 1: then x is (outer, reduced,
    // inner) as it lies; otherwise the kept dims are moved in front first.
    let big: Vec<usize> = (0..r).filter(|&d| x.shape[d] != 1).collect();
    let marks: Vec<bool> = big.iter().map(|d| axes.contains(d)).collect();
    let first = marks.iter().position(|&m| m);
    let last = marks.iter().rposition(|&m| m);
    let block = match (first, last) {
        (Some(f), Some(l)) => marks[f..=l].iter().all(|&m| m),
        _ => true,
    };
    let (src, outer, reduced, inner) = if block {
        let reduced: u64 = axes.iter().map(|&d| x.shape[d] as u64).product();
        let (outer, inner) = match first {
            Some(f) => (numel(&x.shape[..big[f]]), numel(&x.shape[big[last.unwrap_or(f)] + 1..])),
            None => (numel(&x.shape) / reduced.max(1), 1),
        };
        (buf(x), outer, reduced, inner)
    } else {
        let kept: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
        let perm: Vec<usize> = kept.iter().chain(&axes).copied().collect();
        let dims: Vec<usize> = perm.iter().map(|&d| x.shape[d]).collect();
        let xs = contiguous(&x.shape);
        let xs: Vec<i64> = perm.iter().map(|&d| xs[d]).collect();
        let w = p.work(x.bytes());
        p.strided_copy(x.dtype, buf(x), w, &dims, &xs, &contiguous(&dims))?;
        let outer = numel(&dims[..kept.len()]);
        (w, outer, numel(&dims[kept.len()..]), 1)
    };
    if x.dtype == DType::Bool && reduced == 0 {
        // An empty extent: max is false and min is true (the u8 kernels would give 0 and 255).
        let byte = (kind == "min") as u8;
        p.out.calls.push(Call::Fill { to: buf(y), bytes: y.bytes(), byte });
        return Ok(());
    }
    let shape_args = [Arg::I64(outer as i64), Arg::I64(reduced as i64), Arg::I64(inner as i64)];
    let splittable = !matches!(kind, "log_sum_exp");
    if inner == 1 && reduced >= 65536 && outer < 64 && splittable {
        // Long rows and few of them: a two-pass reduction.
        let splits = reduced.div_ceil(16384).min(1024);
        let acc = if x.dtype == DType::F64 || !x.dtype.is_float() { 8 } else { 4 };
        let part = p.work(outer * splits * acc);
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(part)];
        args.extend(shape_args);
        args.push(Arg::I64(splits as i64));
        p.kernel("reduce", format!("reduce_{kind}_split_{t}"), rows_grid(outer * splits), [BLOCK, 1, 1], args);
        let args = vec![
            Arg::Ptr(part),
            Arg::Ptr(buf(y)),
            Arg::I64(outer as i64),
            Arg::I64(splits as i64),
            Arg::I64(reduced as i64),
        ];
        p.kernel("reduce", format!("reduce_{kind}_finish_{t}"), rows_grid(outer), [BLOCK, 1, 1], args);
    } else if inner >= 32 {
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(buf(y))];
        args.extend(shape_args);
        let grid = [inner.div_ceil(32) as u32, outer.clamp(1, MAX_ROWS) as u32, 1];
        p.kernel("reduce", format!("reduce_{kind}_cols_{t}"), grid, [32, 8, 1], args);
    } else {
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(buf(y))];
        args.extend(shape_args);
        p.kernel("reduce", format!("reduce_{kind}_rows_{t}"), rows_grid(outer * inner), [BLOCK, 1, 1], args);
    }
    Ok(())
}

/// The (data, parameter) dtype suffix of the norm kernels.
fn norm_tags(x: DType, param: DType) -> Result<String, String> {
    match (x, param) {
        (DType::F32, DType::F32)
        | (DType::F16, DType::F16)
        | (DType::BF16, DType::BF16)
        | (DType::F16, DType::F32)
        | (DType::BF16, DType::F32)
        | (DType::F64, DType::F64) => Ok(format!("{}_{}", tag(x)?, tag(param)?)),
        _ => Err(format!("normalisation of {x} data with {param} parameters")),
    }
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

/// A statistics output of LayerNormalization, and the workspace (in the kernel's accumulator
/// dtype) to cast into it.
type Stat<'t> = (Arg, Option<(Buf, &'t TensorRef)>);

fn plan_norm(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    match &op {
        Op::LayerNormalization(a) => {
            let (x, scale, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (rows, n, _) = split3(&x.shape, ax, x.shape.len());
            let bias = p.opt_input(2).map_or(Arg::Null, |b| Arg::Ptr(buf(b)));
            // Mean and InvStdDev come from the kernel in its accumulator dtype; another dtype is
            // cast into place.
            let outputs = &p.l.outputs;
            let acc = acc_dtype(x.dtype);
            let stat = |p: &mut Planner, i: usize| -> Result<Stat, String> {
                match outputs.get(i) {
                    None => Ok((Arg::Null, None)),
                    Some(t) if t.dtype == acc => Ok((Arg::Ptr(buf(t)), None)),
                    Some(t) => {
                        let w = p.work(rows * acc.size() as u64);
                        Ok((Arg::Ptr(w), Some((w, t))))
                    }
                }
            };
            let (mean, mean_cast) = stat(p, 1)?;
            let (inv, inv_cast) = stat(p, 2)?;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(scale)),
                bias,
                Arg::Ptr(buf(y)),
                mean,
                inv,
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(scale.numel() as i64),
                Arg::F32(a.epsilon),
            ];
            let name = format!("norm_layer_norm_{}", norm_tags(x.dtype, scale.dtype)?);
            p.kernel("norm", name, rows_grid(rows), [BLOCK, 1, 1], args);
            for (w, t) in [mean_cast, inv_cast].into_iter().flatten() {
                p.cast(acc, t.dtype, w, buf(t), rows)?;
            }
        }
        Op::LayerNormalizationGrad(a) => {
            let (dy, x, scale) = (p.input(0)?, p.input(1)?, p.input(2)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (rows, n, _) = split3(&x.shape, ax, x.shape.len());
            let tags = norm_tags(x.dtype, scale.dtype)?;
            let acc = acc_dtype(x.dtype).size() as u64;
            let (ws_mean, ws_inv) = (p.work(rows * acc), p.work(rows * acc));
            let dx = p.l.outputs.first().map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(scale)),
                dx,
                Arg::Ptr(ws_mean),
                Arg::Ptr(ws_inv),
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(scale.numel() as i64),
                Arg::F32(a.epsilon),
            ];
            p.kernel("norm", format!("norm_layer_norm_grad_{tags}"), rows_grid(rows), [BLOCK, 1, 1], args);
            if let Some(ds) = p.l.outputs.get(1) {
                let db = p.l.outputs.get(2).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
                let sn = scale.numel() as u64;
                let args = vec![
                    Arg::Ptr(buf(dy)),
                    Arg::Ptr(buf(x)),
                    Arg::Ptr(ws_mean),
                    Arg::Ptr(ws_inv),
                    Arg::Ptr(buf(ds)),
                    db,
                    Arg::I64(rows as i64),
                    Arg::I64(n as i64),
                    Arg::I64(sn as i64),
                ];
                p.kernel(
                    "norm",
                    format!("norm_layer_norm_grad_params_{tags}"),
                    [sn.div_ceil(32) as u32, 1, 1],
                    [32, 8, 1],
                    args,
                );
            }
        }
        Op::BatchNormalization(a) => {
            let (x, scale, bias, mean, var, y) =
                (p.input(0)?, p.input(1)?, p.input(2)?, p.input(3)?, p.input(4)?, p.output(0)?);
            if x.shape.len() < 2 {
                return Err("BatchNormalization of a tensor of rank below 2".into());
            }
            let (n, c, inner) = split3(&x.shape, 1, 2);
            let tags = norm_tags(x.dtype, scale.dtype)?;
            let ptr = |t: &TensorRef| Arg::Ptr(buf(t));
            if a.training_mode {
                let rm = p.l.outputs.get(1).map_or(Arg::Null, ptr);
                let rv = p.l.outputs.get(2).map_or(Arg::Null, ptr);
                if rm == Arg::Null || rv == Arg::Null {
                    return Err("training-mode BatchNormalization without its running statistics outputs".into());
                }
                let args = vec![
                    ptr(x),
                    ptr(scale),
                    ptr(bias),
                    ptr(mean),
                    ptr(var),
                    ptr(y),
                    rm,
                    rv,
                    Arg::Null,
                    Arg::Null,
                    Arg::I64(n as i64),
                    Arg::I64(c as i64),
                    Arg::I64(inner as i64),
                    Arg::F32(a.epsilon),
                    Arg::F32(a.momentum),
                ];
                p.kernel("norm", format!("norm_batch_norm_train_{tags}"), rows_grid(c), [BLOCK, 1, 1], args);
            } else {
                let args = vec![
                    ptr(x),
                    ptr(scale),
                    ptr(bias),
                    ptr(mean),
                    ptr(var),
                    ptr(y),
                    Arg::I64(n as i64),
                    Arg::I64(c as i64),
                    Arg::I64(inner as i64),
                    Arg::F32(a.epsilon),
                ];
                p.flat("norm", format!("norm_batch_norm_infer_{tags}"), x.numel() as u64, args);
            }
        }
        Op::BatchNormalizationGrad(a) => {
            let (dy, x, scale) = (p.input(0)?, p.input(1)?, p.input(2)?);
            let tags = norm_tags(x.dtype, scale.dtype)?;
            let c = x.shape.get(1).copied().unwrap_or(1) as u64;
            let inner = numel(&x.shape[2.min(x.shape.len())..]);
            let out = |i: usize| p.l.outputs.get(i).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(scale)),
                out(0),
                out(1),
                out(2),
                Arg::I64(x.shape[0] as i64),
                Arg::I64(c as i64),
                Arg::I64(inner as i64),
                Arg::F32(a.epsilon),
            ];
            p.kernel("norm", format!("norm_batch_norm_grad_{tags}"), rows_grid(c), [BLOCK, 1, 1], args);
        }
        Op::InstanceNormalization(_) | Op::GroupNormalization(_) => {
            let (x, scale, bias, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
            let tags = norm_tags(x.dtype, scale.dtype)?;
            let (n, c) = (x.shape[0] as u64, x.shape.get(1).copied().unwrap_or(1) as u64);
            let inner = numel(&x.shape[2.min(x.shape.len())..]);
            let mut args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(scale)), Arg::Ptr(buf(bias)), Arg::Ptr(buf(y))];
            args.extend([Arg::I64(n as i64), Arg::I64(c as i64)]);
            match &op {
                Op::InstanceNormalization(a) => {
                    args.extend([Arg::I64(inner as i64), Arg::F32(a.epsilon)]);
                    p.kernel("norm", format!("norm_instance_norm_{tags}"), rows_grid(n * c), [BLOCK, 1, 1], args);
                }
                Op::GroupNormalization(a) => {
                    let groups = a.num_groups as u64;
                    args.extend([Arg::I64(groups as i64), Arg::I64(inner as i64), Arg::F32(a.epsilon)]);
                    p.kernel("norm", format!("norm_group_norm_{tags}"), rows_grid(n * groups), [BLOCK, 1, 1], args);
                }
                _ => unreachable!(),
            }
        }
        _ => unreachable!("not a normalisation"),
    }
    Ok(())
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

fn plan_pool(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (Op::MaxPool(a) | Op::AveragePool(a) | Op::MaxPoolGrad(a) | Op::AveragePoolGrad(a)) = &op else {
        unreachable!("not a pooling op")
    };
    let grad = matches!(op, Op::MaxPoolGrad(_) | Op::AveragePoolGrad(_));
    let x = p.input(if grad { 1 } else { 0 })?;
    if x.shape.len() < 3 {
        return Err("pooling of a tensor of rank below 3".into());
    }
    let w = a.window().resolve(&x.shape[2..])?;
    let win = window3(&w, &x.shape[2..])?;
    let planes = (x.shape[0] * x.shape[1]) as u64;
    let t = match (&op, x.dtype) {
        (Op::MaxPool(_), DType::U8 | DType::I8) => tag(x.dtype)?,
        (_, d) => float_tag(d)?,
    };
    let y = p.output(0)?;
    match op {
        Op::MaxPool(_) => {
            let idx = p.l.outputs.get(1).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                idx,
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.storage_order as i32),
            ];
            p.flat("pool", format!("pool_max_{t}"), y.numel() as u64, args);
        }
        Op::AveragePool(_) => {
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.count_include_pad as i32),
            ];
            p.flat("pool", format!("pool_avg_{t}"), y.numel() as u64, args);
        }
        Op::MaxPoolGrad(_) => {
            let dy = p.input(0)?;
            let arg = p.work(dy.numel() as u64 * 8);
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(arg), Arg::I64(planes as i64), Arg::Window(win)];
            p.flat("pool", format!("pool_max_argmax_{t}"), dy.numel() as u64, args);
            let args =
                vec![Arg::Ptr(buf(dy)), Arg::Ptr(arg), Arg::Ptr(buf(y)), Arg::I64(planes as i64), Arg::Window(win)];
            p.flat("pool", format!("pool_max_grad_{t}"), y.numel() as u64, args);
        }
        _ => {
            let dy = p.input(0)?;
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(y)),
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.count_include_pad as i32),
            ];
            p.flat("pool", format!("pool_avg_grad_{t}"), y.numel() as u64, args);
        }
    }
    Ok(())
}

fn plan_conv(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (Op::Conv(a) | Op::ConvGrad(a)) = &op else { unreachable!("not a convolution") };
    let grad = matches!(op, Op::ConvGrad(_));
    let (x, wt) = if grad { (p.input(1)?, p.input(2)?) } else { (p.input(0)?, p.input(1)?) };
    if x.shape.len() < 3 || wt.shape.len() != x.shape.len() {
        return Err("convolution operands of unexpected ranks".into());
    }
    let kernel: Vec<i64> = wt.shape[2..].iter().map(|&k| k as i64).collect();
    let spec: WindowSpec = a.window(&kernel);
    let w = spec.resolve(&x.shape[2..])?;
    let win = window3(&w, &x.shape[2..])?;
    let t = float_tag(x.dtype)?;
    let es = x.dtype.size() as u64;
    let (n, c, m) = (x.shape[0] as u64, x.shape[1] as u64, wt.shape[0] as u64);
    let g = a.group.max(1) as u64;
    let (cg, mg) = (c / g, m / g);
    let ivol = numel(&x.shape[2..]);
    let ovol = numel(&w.out);
    let kvol = numel(&w.kernel);
    let rows = cg * kvol;
    let im2col_args = |x: Buf, col: Buf, col_ld: u64, col_img: u64| {
        vec![
            Arg::Ptr(x),
            Arg::Ptr(col),
            Arg::I64(n as i64),
            Arg::I64(cg as i64),
            Arg::I64((c * ivol) as i64),
            Arg::I64(ivol as i64),
            Arg::Window(win),
            Arg::I64(col_ld as i64),
            Arg::I64(col_img as i64),
        ]
    };
    let pointwise = kvol == 1 && w.strides.iter().all(|&s| s == 1) && w.pads_begin.iter().all(|&q| q == 0);
    if !grad {
        let y = p.output(0)?;
        let col = if pointwise { None } else { Some(p.work(n * rows * ovol * es)) };
        for gi in 0..g {
            let xg = buf(x).at(gi * cg * ivol * es);
            // Per image: Y[i, group] (mg × ovol) = W_g (mg × rows) · col_i (rows × ovol).
            let (src, stride) = match col {
                None => (xg, (c * ivol) as i64),
                Some(col) => {
                    p.flat(
                        "im2col",
                        format!("im2col_im2col_{t}"),
                        n * rows * ovol,
                        im2col_args(xg, col, ovol, rows * ovol),
                    );
                    (col, (rows * ovol) as i64)
                }
            };
            p.gemm(Gemm {
                dtype: y.dtype,
                c_dtype: y.dtype,
                trans_a: false,
                trans_b: false,
                m: ovol as i64,
                n: mg as i64,
                k: rows as i64,
                alpha: 1.0,
                beta: 0.0,
                a: src,
                lda: ovol as i64,
                stride_a: stride,
                b: buf(wt).at(gi * mg * rows * es),
                ldb: rows as i64,
                stride_b: 0,
                c: buf(y).at(gi * mg * ovol * es),
                ldc: ovol as i64,
                stride_c: (m * ovol) as i64,
                batch: n as i64,
            });
        }
        if let Some(b) = p.opt_input(2) {
            let dims = [n as usize, m as usize, ovol as usize];
            p.binary("add", t, (buf(y), &dims), (buf(b), &[m as usize, 1]), buf(y), &dims)?;
        }
        return Ok(());
    }
    // ConvGrad: dY (n, m, ovol) moved to (m, n·ovol) so that one GEMM per group sums the images.
    let dy = p.input(0)?;
    let k2 = n * ovol;
    let dyt = channels_first(p, dy, n, m, ovol)?;
    // The columns: x's for dW, then dX's, which stay f32 for a low-precision convolution so
    // that dX is rounded once, after col2im's sums.
    let (wide, col_dtype) = wide_columns(x.dtype);
    let col = p.work(rows * k2 * es.max(col_dtype.size() as u64));
    let (dx, dw, db) = (p.l.outputs.first(), p.l.outputs.get(1), p.l.outputs.get(2));
    for gi in 0..g {
        let xg = buf(x).at(gi * cg * ivol * es);
        let dyt_g = dyt.at(gi * mg * k2 * es);
        if let Some(dw) = dw {
            // dW_g (mg × rows) = dYᵗ_g (mg × k2) · colᵀ; column-major: dW_gᵀ = col · dYᵗ_gᵀ.
            p.flat("im2col", format!("im2col_im2col_{t}"), n * rows * ovol, im2col_args(xg, col, k2, ovol));
            p.gemm(Gemm {
                dtype: dw.dtype,
                c_dtype: dw.dtype,
                trans_a: true,
                trans_b: false,
                m: rows as i64,
                n: mg as i64,
                k: k2 as i64,
                alpha: 1.0,
                beta: 0.0,
                a: col,
                lda: k2 as i64,
                stride_a: 0,
                b: dyt_g,
                ldb: k2 as i64,
                stride_b: 0,
                c: buf(dw).at(gi * mg * rows * es),
                ldc: rows as i64,
                stride_c: 0,
                batch: 1,
            });
        }
        if let Some(dx) = dx {
            let (dtype, w_g) = (dx.dtype, buf(wt).at(gi * mg * rows * es));
            p.gemm(columns_of_a_transposed_conv(dtype, col_dtype, dyt_g, w_g, col, k2, rows, mg));
            let dxg = buf(dx).at(gi * cg * ivol * es);
            p.flat("im2col", format!("im2col_col2im_{wide}{t}"), n * cg * ivol, im2col_args(col, dxg, k2, ovol));
        }
    }
    if let Some(db) = db {
        let args =
            vec![Arg::Ptr(buf(dy)), Arg::Ptr(buf(db)), Arg::I64(n as i64), Arg::I64(m as i64), Arg::I64(ovol as i64)];
        p.kernel("im2col", format!("im2col_channel_sum_{t}"), rows_grid(m), [BLOCK, 1, 1], args);
    }
    Ok(())
}

/// `t`, an (n, c, vol) batch of images, copied into the workspace as (c, n·vol): each channel's
/// values of every image side by side, so that one GEMM per group covers every image.
fn channels_first(p: &mut Planner, t: &TensorRef, n: u64, c: u64, vol: u64) -> Result<Buf, String> {
    let w = p.work(c * n * vol * t.dtype.size() as u64);
    let (dims, from, to) =
        ([c as usize, n as usize, vol as usize], [vol as i64, (c * vol) as i64, 1], [(n * vol) as i64, vol as i64, 1]);
    p.strided_copy(t.dtype, buf(t), w, &dims, &from, &to)?;
    Ok(w)
}

/// One group's columns of a transposed convolution (ConvGrad's dX, ConvTranspose's Y), for
/// col2im: col (rows × k2) = W_gᵀ · S_g, with S_g (k × k2) the group's channels of the input moved
/// to (channel, image · position) and W_g (k × rows) the group's weights, all row-major. In
/// cuBLAS's column-major terms: colᵀ = S_gᵀ · W_g.
#[allow(clippy::too_many_arguments)]
fn columns_of_a_transposed_conv(
    dtype: DType,
    col_dtype: DType,
    s_g: Buf,
    w_g: Buf,
    col: Buf,
    k2: u64,
    rows: u64,
    k: u64,
) -> Gemm {
    Gemm {
        dtype,
        c_dtype: col_dtype,
        trans_a: false,
        trans_b: true,
        m: k2 as i64,
        n: rows as i64,
        k: k as i64,
        alpha: 1.0,
        beta: 0.0,
        a: s_g,
        lda: k2 as i64,
        stride_a: 0,
        b: w_g,
        ldb: rows as i64,
        stride_b: 0,
        c: col,
        ldc: k2 as i64,
        stride_c: 0,
        batch: 1,
    }
}

/// The columns a GEMM leaves for col2im: f32 for f16/bf16 data (`im2col_col2im_wide_*`), else
/// the data's dtype.
fn wide_columns(d: DType) -> (&'static str, DType) {
    match d {
        DType::F16 | DType::BF16 => ("wide_", DType::F32),
        d => ("", d),
    }
}

fn plan_conv_transpose(p: &mut Planner, a: &mpc_ir::ops::ConvAttrs) -> Result<(), String> {
    let (x, wt, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let sp = x.shape.len().saturating_sub(2);
    if sp == 0 || wt.shape.len() != x.shape.len() || y.shape.len() != x.shape.len() {
        return Err("ConvTranspose operands of unexpected ranks".into());
    }
    let kernel: Vec<i64> = wt.shape[2..].iter().map(|&k| k as i64).collect();
    let spec = a.window(&kernel);
    let mut w = Window {
        kernel: wt.shape[2..].to_vec(),
        strides: Vec::new(),
        dilations: Vec::new(),
        pads_begin: Vec::new(),
        pads_end: Vec::new(),
        out: x.shape[2..].to_vec(),
    };
    for d in 0..sp {
        let target = (!a.output_shape.is_empty()).then(|| a.output_shape[a.output_shape.len() - sp + d]);
        let pad = a.output_padding.get(d).copied().unwrap_or(0);
        let o = mpc_ir::geometry::conv_transpose_dim(&spec, d, x.shape[2 + d] as u64, pad, target)?;
        if o.out as usize != y.shape[2 + d] {
            return Err(format!("ConvTranspose output dim {} where the graph declares {}", o.out, y.shape[2 + d]));
        }
        w.strides.push(a.strides.get(d).copied().unwrap_or(1) as usize);
        w.dilations.push(a.dilations.get(d).copied().unwrap_or(1) as usize);
        w.pads_begin.push(o.pad_begin as usize);
        w.pads_end.push(o.pad_end as usize);
    }
    // col2im's geometry: the image is Y, the columns' positions are X's.
    let win = window3(&w, &y.shape[2..])?;
    let t = float_tag(x.dtype)?;
    let es = x.dtype.size() as u64;
    let (n, cin) = (x.shape[0] as u64, x.shape[1] as u64);
    let g = a.group.max(1) as u64;
    let (cg, og) = (cin / g, wt.shape[1] as u64);
    let cout = og * g;
    let (ivol, ovol, kvol) = (numel(&x.shape[2..]), numel(&y.shape[2..]), numel(&w.kernel));
    let (rows, k2) = (og * kvol, n * ivol);
    // X (n, cin, ivol) moved to (cin, n·ivol) so that one GEMM per group covers every image.
    let xt = channels_first(p, x, n, cin, ivol)?;
    let (wide, col_dtype) = wide_columns(x.dtype);
    let col = p.work(rows * k2 * col_dtype.size() as u64);
    for gi in 0..g {
        let (x_g, w_g) = (xt.at(gi * cg * k2 * es), buf(wt).at(gi * cg * rows * es));
        p.gemm(columns_of_a_transposed_conv(y.dtype, col_dtype, x_g, w_g, col, k2, rows, cg));
        let args = vec![
            Arg::Ptr(col),
            Arg::Ptr(buf(y).at(gi * og * ovol * es)),
            Arg::I64(n as i64),
            Arg::I64(og as i64),
            Arg::I64((cout * ovol) as i64),
            Arg::I64(ovol as i64),
            Arg::Window(win),
            Arg::I64(k2 as i64),
            Arg::I64(ivol as i64),
        ];
        p.flat("im2col", format!("im2col_col2im_{wide}{t}"), n * og * ovol, args);
    }
    if let Some(b) = p.opt_input(2) {
        let dims = [n as usize, cout as usize, ovol as usize];
        p.binary("add", t, (buf(y), &dims), (buf(b), &[cout as usize, 1]), buf(y), &dims)?;
    }
    Ok(())
}

fn plan_slice(p: &mut Planner) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let r = x.shape.len();
    let starts = p.host_ints(1).ok_or("Slice's starts are not known")?;
    let ends = p.host_ints(2).ok_or("Slice's ends are not known")?;
    let axes = p.host_ints(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = p.host_ints(4).unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err("Slice's starts, ends, axes and steps differ in length".into());
    }
    let xs = contiguous(&x.shape);
    let mut strides = xs.clone();
    let mut first = 0i64;
    for i in 0..starts.len() {
        let ax = normalize_axis(axes[i], r).ok_or("axis out of range")?;
        let (b, _) = slice_dim(x.shape[ax] as i64, starts[i], ends[i], steps[i])?;
        if y.shape[ax] > 0 {
            first += b * xs[ax];
        }
        strides[ax] = xs[ax] * steps[i];
    }
    let from = buf(x).at((first as u64) * x.dtype.size() as u64);
    p.strided_copy(x.dtype, from, buf(y), &y.shape, &strides, &contiguous(&y.shape))
}

fn plan_pad(p: &mut Planner, mode: PadMode) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let r = x.shape.len();
    let pads = p.host_ints(1).ok_or("Pad's pads are not known")?;
    let axes: Vec<usize> = match p.host_ints(3) {
        Some(v) => v.iter().map(|&a| normalize_axis(a, r).ok_or("axis out of range")).collect::<Result<_, _>>()?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err("Pad's pads do not match its axes".into());
    }
    let mut before = vec![0i64; r];
    for (i, &a) in axes.iter().enumerate() {
        before[a] = pads[i];
    }
    let mut bits = [0u8; 8];
    if let Some(v) = p.opt_input(2) {
        match (p.constant)(v) {
            Some(c) => {
                let c = c.cast(x.dtype);
                c.write_le_bytes(&mut bits[..c.bytes().min(8)]);
            }
            // The other modes never read the value.
            None if mode == PadMode::Constant => return pad_from_device(p, x, v, y, &before),
            None => {}
        }
    } else if let Some(v) = p.host(2) {
        let c = v.cast(x.dtype);
        c.write_le_bytes(&mut bits[..c.bytes().min(8)]);
    }
    let code = match mode {
        PadMode::Constant => 0,
        PadMode::Reflect => 1,
        PadMode::Edge => 2,
        PadMode::Wrap => 3,
    };
    let n = y.numel() as u64;
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I32(r as i32),
        Arg::Dims(dims8(&us(&y.shape))?),
        Arg::Dims(dims8(&us(&x.shape))?),
        Arg::Dims(dims8(&contiguous(&x.shape))?),
        Arg::Dims(dims8(&before)?),
        Arg::I32(code),
        Arg::U64(u64::from_le_bytes(bits)),
    ];
    p.flat("movement", format!("movement_pad_{}", size_tag(x.dtype)?), n, args);
    Ok(())
}

/// Einsum of up to three float operands, one thread per output element summing in f64 in the
/// CPU reference's order (a contraction kernel, not a GEMM: Einsum in exported models is rare).
fn plan_einsum(p: &mut Planner, equation: &str) -> Result<(), String> {
    let (terms, rhs) = mpc_ir::ops::einsum_parts(equation)?;
    let lhs = terms.join(",");
    let ins: Vec<&TensorRef> = (0..terms.len()).map(|i| p.input(i)).collect::<Result<_, _>>()?;
    if ins.len() > 3 {
        return Err(format!("Einsum of {} operands (the CUDA kernel takes up to 3)", ins.len()));
    }
    let y = p.output(0)?;
    let mut letters: Vec<char> = rhs.chars().collect();
    for c in lhs.chars().filter(|c| c.is_ascii_alphabetic()) {
        if !letters.contains(&c) {
            letters.push(c);
        }
    }
    let mut sizes = vec![0i64; letters.len()];
    let mut strides = vec![vec![0i64; letters.len()]; 3];
    for (k, (t, x)) in terms.iter().zip(&ins).enumerate() {
        if t.len() != x.shape.len() || x.dtype != y.dtype {
            return Err(format!("Einsum term `{t}` on {}{:?}", x.dtype, x.shape));
        }
        let st = contiguous(&x.shape);
        for (i, c) in t.chars().enumerate() {
            let l = letters.iter().position(|&l| l == c).ok_or("an Einsum label")?;
            sizes[l] = x.shape[i] as i64;
            strides[k][l] += st[i];
        }
    }
    let nout = rhs.chars().count();
    let n_out: i64 = sizes[..nout].iter().product();
    let inner: i64 = sizes[nout..].iter().product();
    let ptr = |k: usize| ins.get(k).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
    let args = vec![
        ptr(0),
        ptr(1),
        ptr(2),
        Arg::Ptr(buf(y)),
        Arg::I64(n_out),
        Arg::I64(inner),
        Arg::I32(ins.len() as i32),
        Arg::I32(letters.len() as i32),
        Arg::I32(nout as i32),
        Arg::Dims(dims8(&sizes)?),
        Arg::Dims(dims8(&strides[0])?),
        Arg::Dims(dims8(&strides[1])?),
        Arg::Dims(dims8(&strides[2])?),
    ];
    p.flat("reduce", format!("reduce_einsum_{}", float_tag(y.dtype)?), n_out as u64, args);
    Ok(())
}

fn plan_resize(p: &mut Planner, a: &mpc_ir::ops::ResizeAttrs) -> Result<(), String> {
    use mpc_ir::ops::{AspectPolicy, ResizeMode};
    let (x, y) = (p.input(0)?, p.output(0)?);
    if a.antialias || a.keep_aspect_ratio_policy != AspectPolicy::Stretch || a.mode == ResizeMode::Cubic {
        return Err("Resize with cubic mode, antialias or an aspect-ratio policy".into());
    }
    let t = float_tag(x.dtype)?;
    let scales = p.host(2).filter(|s| !s.is_empty()).map(|s| s.f64s());
    let sizes = p.host(3).filter(|s| !s.is_empty()).and_then(|s| s.i64s());
    let (out, scale) = mpc_ir::geometry::resize_plan(a, &x.shape, scales.as_deref(), sizes.as_deref())?;
    if out != y.shape {
        return Err(format!("Resize to {out:?} where the graph declares {:?}", y.shape));
    }
    let (mut count, mut idx, mut w, mut base) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for d in 0..x.shape.len() {
        base.push(count.len() as i64);
        for taps in mpc_ir::geometry::resize_taps(a, x.shape[d], out[d], scale[d])? {
            if taps.is_empty() || taps.len() > 2 {
                return Err(format!("a Resize output sampling {} inputs", taps.len()));
            }
            count.push(taps.len() as i64);
            for k in 0..2 {
                let (i, wt) = taps.get(k).copied().unwrap_or((0, 0.0));
                idx.push(i as i64);
                w.push(wt);
            }
        }
    }
    let le = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (count, idx) = (p.aux(&le(&count)), p.aux(&le(&idx)));
    let w = p.aux(&w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    let n = y.numel() as u64;
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I32(x.shape.len() as i32),
        Arg::Dims(dims8(&us(&y.shape))?),
        Arg::Dims(dims8(&contiguous(&x.shape))?),
        Arg::Dims(dims8(&base)?),
        Arg::Ptr(count),
        Arg::Ptr(idx),
        Arg::Ptr(w),
    ];
    p.flat("movement", format!("movement_resize_{t}"), n, args);
    Ok(())
}

/// Constant Pad whose value is computed on the device: the value broadcast over the output,
/// then the part of the input the output keeps copied into place.
fn pad_from_device(p: &mut Planner, x: &TensorRef, v: &TensorRef, y: &TensorRef, before: &[i64]) -> Result<(), String> {
    if v.numel() != 1 || v.dtype != x.dtype {
        return Err("Pad's constant value must be one value of the input's dtype".into());
    }
    p.expand(y.dtype, buf(v), &v.shape, buf(y), &y.shape)?;
    let (xs, ys) = (contiguous(&x.shape), contiguous(&y.shape));
    let (mut from, mut to, mut dims) = (0i64, 0i64, Vec::with_capacity(x.shape.len()));
    for d in 0..x.shape.len() {
        let (out_start, in_start) = (before[d].max(0), (-before[d]).max(0));
        let len = (x.shape[d] as i64 - in_start).min(y.shape[d] as i64 - out_start).max(0);
        from += in_start * xs[d];
        to += out_start * ys[d];
        dims.push(len as usize);
    }
    let es = x.dtype.size() as u64;
    p.strided_copy(x.dtype, buf(x).at(from as u64 * es), buf(y).at(to as u64 * es), &dims, &xs, &ys)
}

fn plan_gather_nd(p: &mut Planner, batch_dims: i64) -> Result<(), String> {
    let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let (r, q) = (x.shape.len(), idx.shape.len());
    let b = usize::try_from(batch_dims).ok().filter(|&b| b < r.min(q)).ok_or("GatherND's batch_dims")?;
    let k = idx.shape[q - 1];
    if k == 0 || k > r - b || x.shape[..b] != idx.shape[..b] {
        return Err("GatherND's indices do not fit its data".into());
    }
    let tuples = idx.numel() as u64 / k as u64;
    let batch = numel(&x.shape[..b]).max(1);
    let run = numel(&x.shape[b + k..]);
    let st = contiguous(&x.shape[b..]);
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(idx)),
        Arg::Ptr(buf(y)),
        Arg::I64(tuples as i64),
        Arg::I32(k as i32),
        Arg::I64(run as i64),
        Arg::I64((tuples / batch).max(1) as i64),
        Arg::I64(numel(&x.shape[b..]) as i64),
        Arg::Dims(dims8(&us(&x.shape[b..b + k]))?),
        Arg::Dims(dims8(&st[..k])?),
        Arg::Ptr(Buf::Flag),
    ];
    let name = format!("gather_nd_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
    p.flat("gather", name, tuples * run, args);
    Ok(())
}

/// ScatterND (`axis` None) or ScatterElements: the data copied into the output, then the updates
/// applied in order by one thread per output element.
fn plan_scatter(p: &mut Planner, axis: Option<i64>, reduction: mpc_ir::ops::ScatterReduction) -> Result<(), String> {
    use mpc_ir::ops::ScatterReduction as R;
    let (x, idx, upd, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
    let t = match x.dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I64 | DType::I32 => tag(x.dtype)?,
        d => return Err(format!("a scatter of {d} (f32, f16, bf16, f64, i64 and i32 run on cuda)")),
    };
    let it = index_tag(idx.dtype)?;
    let red = match reduction {
        R::None => 0,
        R::Add => 1,
        R::Mul => 2,
        R::Max => 3,
        R::Min => 4,
    };
    p.copy(buf(x), buf(y), y.bytes());
    let n_out = y.numel() as u64;
    let head = [Arg::Ptr(buf(idx)), Arg::Ptr(buf(upd)), Arg::Ptr(buf(y)), Arg::I64(n_out as i64)];
    let (name, mut args) = match axis {
        None => {
            let q = idx.shape.len();
            let k = *idx.shape.last().ok_or("ScatterND's indices of rank 0")?;
            if k > x.shape.len() {
                return Err("ScatterND's index tuples are longer than the data's rank".into());
            }
            let st = contiguous(&x.shape);
            let mut a = head.to_vec();
            a.extend([
                Arg::I64(numel(&idx.shape[..q - 1]) as i64),
                Arg::I32(k as i32),
                Arg::I64(numel(&x.shape[k..]) as i64),
                Arg::Dims(dims8(&us(&x.shape[..k]))?),
                Arg::Dims(dims8(&st[..k])?),
            ]);
            (format!("gather_scatter_nd_{t}_{it}"), a)
        }
        Some(axis) => {
            let r = x.shape.len();
            let ax = normalize_axis(axis, r).ok_or("axis out of range")?;
            if idx.shape.len() != r || upd.shape != idx.shape {
                return Err("ScatterElements' indices and updates do not fit its data".into());
            }
            let mut a = head.to_vec();
            a.extend([
                Arg::I64(idx.numel() as i64),
                Arg::I32(r as i32),
                Arg::Dims(dims8(&us(&idx.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
                Arg::I32(ax as i32),
                Arg::I64(x.shape[ax] as i64),
            ]);
            (format!("gather_scatter_elements_{t}_{it}"), a)
        }
    };
    args.extend([Arg::I32(red), Arg::Ptr(Buf::Flag)]);
    p.flat("gather", name, n_out, args);
    Ok(())
}

fn plan_gather_grad(p: &mut Planner, axis: i64) -> Result<(), String> {
    let (dy, idx, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let ax = normalize_axis(axis, dx.shape.len()).ok_or("axis out of range")?;
    let (outer, len, inner) = split3(&dx.shape, ax, ax + 1);
    let count = idx.numel() as u64;
    let t = float_tag(dx.dtype)?;
    let it = index_tag(idx.dtype)?;
    let n = dx.numel() as u64;
    if count <= 64 || count >= 1 << 32 || len >= 1 << 31 {
        let args = vec![
            Arg::Ptr(buf(dy)),
            Arg::Ptr(buf(idx)),
            Arg::Ptr(buf(dx)),
            Arg::I64(outer as i64),
            Arg::I64(len as i64),
            Arg::I64(count as i64),
            Arg::I64(inner as i64),
        ];
        p.flat("gather", format!("gather_grad_direct_{t}_{it}"), n, args);
        return Ok(());
    }
    let padded = count.next_power_of_two().max(2048);
    let keys = p.work(padded * 8);
    let seg = p.work((len + 1) * 8);
    let args =
        vec![Arg::Ptr(buf(idx)), Arg::Ptr(keys), Arg::I64(count as i64), Arg::I64(padded as i64), Arg::I64(len as i64)];
    p.flat("gather", format!("gather_grad_keys_{it}"), padded, args);
    let chunks = (padded / 2048) as u32;
    p.kernel(
        "gather",
        "gather_sort_local".into(),
        [chunks, 1, 1],
        [BLOCK, 1, 1],
        vec![Arg::Ptr(keys), Arg::I64(padded as i64)],
    );
    let mut k = 4096;
    while k <= padded {
        let mut j = k / 2;
        while j >= 2048 {
            let args = vec![Arg::Ptr(keys), Arg::I64(padded as i64), Arg::I64(k as i64), Arg::I64(j as i64)];
            p.flat("gather", "gather_sort_step".into(), padded / 2, args);
            j /= 2;
        }
        let args = vec![Arg::Ptr(keys), Arg::I64(padded as i64), Arg::I64(k as i64)];
        p.kernel("gather", "gather_sort_merge_local".into(), [chunks, 1, 1], [BLOCK, 1, 1], args);
        k *= 2;
    }
    let args = vec![Arg::Ptr(keys), Arg::I64(count as i64), Arg::I64(len as i64), Arg::Ptr(seg)];
    p.flat("gather", "gather_grad_segments".into(), len + 1, args);
    let args = vec![
        Arg::Ptr(buf(dy)),
        Arg::Ptr(keys),
        Arg::Ptr(seg),
        Arg::Ptr(buf(dx)),
        Arg::I64(outer as i64),
        Arg::I64(len as i64),
        Arg::I64(count as i64),
        Arg::I64(inner as i64),
    ];
    p.flat("gather", format!("gather_grad_sorted_{t}"), n, args);
    Ok(())
}

fn plan_loss(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let a = match &op {
        Op::SoftmaxCrossEntropyLoss(a) | Op::NegativeLogLikelihoodLoss(a) => a,
        Op::SoftmaxCrossEntropyLossGrad(a) | Op::NegativeLogLikelihoodLossGrad(a) => &**a,
        _ => unreachable!("not a loss"),
    };
    let grad = matches!(op, Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_));
    let softmax = matches!(op, Op::SoftmaxCrossEntropyLoss(_) | Op::SoftmaxCrossEntropyLossGrad(_));
    let base = grad as usize;
    let (scores, labels) = (p.input(base)?, p.input(base + 1)?);
    let weights = p.opt_input(base + 2).map_or(Arg::Null, |w| Arg::Ptr(buf(w)));
    if scores.shape.len() < 2 {
        return Err("loss scores of rank below 2".into());
    }
    let (n, c, inner) = split3(&scores.shape, 1, 2);
    let positions = n * inner;
    let t = match scores.dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => tag(scores.dtype)?,
        d => return Err(format!("a loss on {d} scores")),
    };
    let it = index_tag(labels.dtype)?;
    let reduction = match a.reduction {
        Reduction::None => 0,
        Reduction::Sum => 1,
        Reduction::Mean => 2,
    };
    let ignore = [Arg::I32(a.ignore_index.is_some() as i32), Arg::I64(a.ignore_index.unwrap_or(0))];
    let dims = [Arg::I64(n as i64), Arg::I64(c as i64), Arg::I64(inner as i64)];
    let block = if c <= 128 { 32 } else { BLOCK };
    let acc = acc_dtype(scores.dtype).size() as u64;
    if !grad {
        let loss = p.output(0)?;
        let (ws_loss, ws_weight, none) = if reduction == 0 {
            (Arg::Null, Arg::Null, Arg::Ptr(buf(loss)))
        } else {
            (Arg::Ptr(p.work(positions * acc)), Arg::Ptr(p.work(positions * acc)), Arg::Null)
        };
        let mut args = vec![Arg::Ptr(buf(scores)), Arg::Ptr(buf(labels)), weights];
        if softmax {
            args.push(p.l.outputs.get(1).map_or(Arg::Null, |t| Arg::Ptr(buf(t))));
        }
        args.extend([ws_loss, ws_weight, none]);
        args.extend(dims);
        args.extend(ignore);
        if softmax {
            p.kernel("loss", format!("loss_softmax_ce_{t}_{it}"), rows_grid(positions), [block, 1, 1], args);
        } else {
            p.flat("loss", format!("loss_nll_{t}_{it}"), positions, args);
        }
        if reduction != 0 {
            let args = vec![ws_loss, ws_weight, Arg::Ptr(buf(loss)), Arg::I64(positions as i64), Arg::I32(reduction)];
            p.kernel("loss", format!("loss_reduce_{t}"), [1, 1, 1], [BLOCK, 1, 1], args);
        }
        return Ok(());
    }
    let (dloss, d) = (p.input(0)?, p.output(0)?);
    let total = if reduction == 2 {
        let total = p.work(acc);
        let mut args =
            vec![Arg::Ptr(buf(labels)), weights, Arg::Ptr(total), Arg::I64(positions as i64), Arg::I64(c as i64)];
        args.extend(ignore);
        p.kernel("loss", format!("loss_weight_total_{t}_{it}"), [1, 1, 1], [BLOCK, 1, 1], args);
        Arg::Ptr(total)
    } else {
        Arg::Null
    };
    let mut args =
        vec![Arg::Ptr(buf(dloss)), Arg::Ptr(buf(scores)), Arg::Ptr(buf(labels)), weights, total, Arg::Ptr(buf(d))];
    args.extend(dims);
    args.extend(ignore);
    args.push(Arg::I32(reduction));
    if softmax {
        p.kernel("loss", format!("loss_softmax_ce_grad_{t}_{it}"), rows_grid(positions), [block, 1, 1], args);
    } else {
        p.flat("loss", format!("loss_nll_grad_{t}_{it}"), d.numel() as u64, args);
    }
    Ok(())
}

/// The `<param>_<grad>` dtype suffix of the update kernels: a gradient of the parameter's dtype,
/// or an f16/bf16 one of an f32 parameter (the master weights of mixed precision).
fn update_tags(op: &str, param: DType, grad: DType) -> Result<String, String> {
    match (param, grad) {
        (p, g) if p == g && p.is_float() => Ok(format!("{}_{}", float_tag(p)?, float_tag(g)?)),
        (DType::F32, DType::F16 | DType::BF16) => Ok(format!("f32_{}", float_tag(grad)?)),
        _ => Err(format!("{op} of {param} parameters with {grad} gradients")),
    }
}

/// An update's optional `inv_scale` input (slot `i`): a pointer to the f32 scalar, or null. Only
/// f32 and f64 parameters take one (the kernels multiply in their compute type).
fn unscale_arg(p: &Planner, i: usize, param: DType) -> Result<Arg, String> {
    match p.opt_input(i) {
        None => Ok(Arg::Null),
        Some(_) if !matches!(param, DType::F32 | DType::F64) => Err(format!("an inv_scale with {param} parameters")),
        Some(t) if t.dtype == DType::F32 && t.numel() == 1 => Ok(Arg::Ptr(buf(t))),
        Some(t) => Err(format!("an update's inv_scale must be one f32, not {}{:?}", t.dtype, t.shape)),
    }
}

fn plan_train(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    match &op {
        Op::AllFinite => {
            let f = p.output(0)?;
            p.kernel("train", "train_all_finite_init".into(), [1, 1, 1], [1, 1, 1], vec![Arg::Ptr(buf(f))]);
            let floats: Vec<&TensorRef> = (0..p.l.inputs.len())
                .filter_map(|i| p.opt_input(i))
                .filter(|x| x.dtype.is_float() && x.numel() > 0)
                .collect();
            if let [x] = floats[..] {
                let n = x.numel() as u64;
                let args = vec![Arg::Ptr(buf(x)), Arg::I64(n as i64), Arg::Ptr(buf(f))];
                p.flat("train", format!("train_all_finite_{}", float_tag(x.dtype)?), n, args);
            } else if !floats.is_empty() {
                // Every gradient in one launch: arrays of addresses, sizes and dtype codes.
                let ptrs = p.aux(&vec![0u8; 8 * floats.len()]);
                let Buf::Aux(at) = ptrs else { unreachable!("aux bytes") };
                for (k, x) in floats.iter().enumerate() {
                    p.out.addresses.push((at + 8 * k as u64, buf(x)));
                }
                let sizes: Vec<u8> = floats.iter().flat_map(|x| (x.numel() as i64).to_le_bytes()).collect();
                let codes: Vec<u8> = floats
                    .iter()
                    .flat_map(|x| {
                        let code: i32 = match x.dtype {
                            DType::F32 => 0,
                            DType::F16 => 1,
                            DType::BF16 => 2,
                            _ => 3,
                        };
                        code.to_le_bytes()
                    })
                    .collect();
                let (sizes, codes) = (p.aux(&sizes), p.aux(&codes));
                let count = floats.len() as u64;
                let widest = floats.iter().map(|x| x.numel() as u64).max().unwrap_or(1);
                let grid = [widest.div_ceil(BLOCK as u64).clamp(1, 64) as u32, count.min(MAX_ROWS) as u32, 1];
                let args =
                    vec![Arg::Ptr(ptrs), Arg::Ptr(sizes), Arg::Ptr(codes), Arg::I32(count as i32), Arg::Ptr(buf(f))];
                p.kernel("train", "train_all_finite_multi".into(), grid, [BLOCK, 1, 1], args);
            }
        }
        Op::SgdUpdate(a) => {
            let (param, grad, finite) = (p.input(0)?, p.input(1)?, p.input(2)?);
            let vel = p.opt_input(3);
            let out = p.output(0)?;
            let n = param.numel() as u64;
            let tags = update_tags("SgdUpdate", param.dtype, grad.dtype)?;
            let inv = unscale_arg(p, 4, param.dtype)?;
            let args = vec![
                Arg::Ptr(buf(param)),
                Arg::Ptr(buf(grad)),
                inv,
                Arg::Ptr(buf(finite)),
                vel.map_or(Arg::Null, |v| Arg::Ptr(buf(v))),
                Arg::Ptr(buf(out)),
                p.l.outputs.get(1).map_or(Arg::Null, |v| Arg::Ptr(buf(v))),
                Arg::I64(n as i64),
                Arg::F32(a.lr),
                Arg::F32(a.momentum),
                Arg::F32(a.weight_decay),
                Arg::I32(a.nesterov as i32),
            ];
            p.flat("train", format!("train_sgd_{tags}"), n, args);
        }
        Op::AdamUpdate(a) => {
            let ins: Vec<&TensorRef> = (0..6).map(|i| p.input(i)).collect::<Result<_, _>>()?;
            let (param, grad, step) = (ins[0], ins[1], ins[4]);
            if step.dtype != DType::I64 {
                return Err(format!("AdamUpdate with a {} step", step.dtype));
            }
            let tags = update_tags("AdamUpdate", param.dtype, grad.dtype)?;
            let n = param.numel() as u64;
            let mut args = vec![Arg::Ptr(buf(param)), Arg::Ptr(buf(grad)), unscale_arg(p, 6, param.dtype)?];
            args.extend(ins[2..].iter().map(|t| Arg::Ptr(buf(t))));
            for i in 0..3 {
                args.push(Arg::Ptr(buf(p.output(i)?)));
            }
            args.extend([
                Arg::I64(n as i64),
                Arg::F32(a.lr),
                Arg::F32(a.beta1),
                Arg::F32(a.beta2),
                Arg::F32(a.epsilon),
                Arg::F32(a.weight_decay),
                Arg::I32(a.decoupled as i32),
            ]);
            p.flat("train", format!("train_adam_{tags}"), n, args);
        }
        Op::LossScaleUpdate(a) => {
            let (scale, good, finite) = (p.input(0)?, p.input(1)?, p.input(2)?);
            if scale.dtype != DType::F32 || good.dtype != DType::I64 {
                return Err(format!("LossScaleUpdate of a {} scale and {} count", scale.dtype, good.dtype));
            }
            let args = vec![
                Arg::Ptr(buf(scale)),
                Arg::Ptr(buf(good)),
                Arg::Ptr(buf(finite)),
                Arg::Ptr(buf(p.output(0)?)),
                Arg::Ptr(buf(p.output(1)?)),
                Arg::F32(a.growth_factor),
                Arg::F32(a.backoff_factor),
                Arg::I64(a.growth_interval),
                Arg::F32(a.min_scale),
                Arg::F32(a.max_scale),
            ];
            p.kernel("train", "train_loss_scale_update".into(), [1, 1, 1], [1, 1, 1], args);
        }
        Op::SeededDropout(a) => {
            let (x, key, y) = (p.input(0)?, p.input(2)?, p.output(0)?);
            let n = x.numel() as u64;
            let (ratio_ptr, ratio) = match (p.opt_input(1), p.host(1)) {
                (Some(r), _) => match (p.constant)(r) {
                    Some(v) => (Arg::Null, v.f64s().first().copied().unwrap_or(0.5)),
                    None if r.dtype == DType::F64 => (Arg::Ptr(buf(r)), 0.5),
                    None => {
                        let w = p.work(8);
                        p.cast(r.dtype, DType::F64, buf(r), w, 1)?;
                        (Arg::Ptr(w), 0.5)
                    }
                },
                (None, Some(v)) => (Arg::Null, v.f64s().first().copied().unwrap_or(0.5)),
                _ => (Arg::Null, 0.5),
            };
            if !(0.0..1.0).contains(&ratio) {
                return Err(format!("a dropout ratio of {ratio}, outside [0, 1)"));
            }
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(key)),
                ratio_ptr,
                Arg::Ptr(buf(y)),
                p.l.outputs.get(1).map_or(Arg::Null, |m| Arg::Ptr(buf(m))),
                Arg::I64(n as i64),
                Arg::I64(a.seed),
                Arg::F64(ratio),
            ];
            p.flat("train", format!("train_seeded_dropout_{}", float_tag(x.dtype)?), n, args);
        }
        Op::ReluGrad | Op::GeluGrad(_) => {
            let (dy, x, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let n = dx.numel() as u64;
            let t = float_tag(dx.dtype)?;
            let mut args = vec![Arg::Ptr(buf(dy)), Arg::Ptr(buf(x)), Arg::Ptr(buf(dx)), Arg::I64(n as i64)];
            let name = if let Op::GeluGrad(a) = &op {
                args.push(Arg::I32((a.approximate == GeluApprox::Tanh) as i32));
                "gelu_grad"
            } else {
                "relu_grad"
            };
            p.flat("train", format!("train_{name}_{t}"), n, args);
        }
        _ => unreachable!("not a training op"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn parameters_are_laid_out_as_c_does() {
        let args =
            [Arg::Ptr(Buf::Work(0)), Arg::I32(1), Arg::Dims([0; 8]), Arg::F32(1.0), Arg::Window(Window3::default())];
        let (offsets, total) = param_offsets(&args);
        assert_eq!(offsets, vec![0, 8, 16, 80, 88]);
        assert_eq!(total, 264);
        assert_eq!(Window3::default().bytes().len(), 176);
        assert_eq!(std::mem::size_of::<Window3>(), 176);
    }

    #[test]
    fn reductions_over_one_block_of_dims_need_no_transpose() {
        use mpc_ir::ops::ReduceAttrs;
        let t =
            |shape: &[usize]| TensorRef { region: Region::Arena, offset: 0, dtype: DType::F32, shape: shape.to_vec() };
        let launch = |axes: Vec<i64>, out: &[usize]| Launch {
            node: "r".into(),
            op: Op::ReduceSum(ReduceAttrs { keepdims: true, noop_with_empty_axes: false }),
            inputs: vec![
                Operand::Device(t(&[4, 1, 6, 8])),
                Operand::Host(HostTensor::from_i64(DType::I64, vec![axes.len()], axes)),
            ],
            outputs: vec![t(out)],
            branches: None,
        };
        let none = |_: &TensorRef| None;
        // Axes 1 and 2 (1 has size 1): one block, rows of 6 read with stride 8 (cols).
        let plan1 = plan(&launch(vec![1, 2], &[4, 1, 1, 8]), &none).unwrap();
        assert_eq!(plan1.calls.len(), 1);
        let Call::Kernel(k) = &plan1.calls[0] else { panic!() };
        assert_eq!(k.name, "reduce_sum_rows_f32");
        assert_eq!(&k.args[2..5], &[Arg::I64(4), Arg::I64(6), Arg::I64(8)]);
        // Axes 0 and 3 are not adjacent: a transposed copy first.
        let plan2 = plan(&launch(vec![0, 3], &[1, 1, 6, 1]), &none).unwrap();
        assert_eq!(plan2.calls.len(), 2);
        assert!(plan2.workspace >= 4 * 6 * 8 * 4);
        let Call::Kernel(k) = &plan2.calls[1] else { panic!() };
        assert_eq!(&k.args[2..5], &[Arg::I64(6), Arg::I64(32), Arg::I64(1)]);
    }
}
