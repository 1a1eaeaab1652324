//! The CPU reference backend: every op on host tensors, FP16/BF16 stored as half with f32
//! arithmetic, deterministic. Ops (or forms) not implemented yet are a typed `Unsupported` error,
//! never a guess.

mod attention;
mod elementwise;
mod extra;
mod indexing;
mod linalg;
mod nn;
mod resize;
mod roi_align;
mod shape;
mod train;

pub use train::scheduled_rate;
pub(crate) mod views;

use mpc_ir::geometry::WindowSpec;
use mpc_ir::ops::{AdamAttrs, ConvAttrs, PoolAttrs, SgdAttrs};
use mpc_ir::{normalize_axis, DType, Kind, Op, Tensor};

use crate::value::{Data, HostTensor};

/// Why a kernel did not produce outputs.
#[derive(Debug)]
pub enum KernelError {
    /// The inputs are invalid for the op (a shape mismatch, an index out of range).
    Invalid(String),
    /// mpc's CPU backend does not implement this op or form yet.
    Unsupported(String),
}

pub(crate) type Res<T> = Result<T, KernelError>;

/// An output whose shape comes from data (ConstantOfShape, Range, Expand, Tile, Pad) is
/// refused before it is allocated when it is more than a program may hold.
pub(crate) fn fits(shape: &[usize], dtype: mpc_ir::DType, limit: u64) -> Res<()> {
    match shape.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64)) {
        Some(b) if b <= limit => Ok(()),
        _ => Err(err(format!("an output of {dtype}{shape:?} is more than the {limit} bytes a program may hold"))),
    }
}

pub(crate) fn err(msg: impl Into<String>) -> KernelError {
    KernelError::Invalid(msg.into())
}

pub(crate) fn unsupported(msg: impl Into<String>) -> KernelError {
    KernelError::Unsupported(msg.into())
}

/// Rounds f64 results through f32 (the compute type of f32/f16/bf16) into `like`'s dtype; f64
/// stays f64.
pub(crate) fn store(like: &HostTensor, shape: Vec<usize>, v: Vec<f64>) -> HostTensor {
    if like.dtype() == DType::F64 {
        HostTensor { shape, data: Data::F64(v.into()) }
    } else {
        HostTensor::from_f32(like.dtype(), shape, v.into_iter().map(|x| x as f32).collect())
    }
}

/// A float tensor's values as f64; another dtype is an error naming `what`.
pub(crate) fn floats(x: &HostTensor, what: &str) -> Res<Vec<f64>> {
    if !x.dtype().is_float() {
        return Err(err(format!("{what}: {} where a float tensor was expected", x.dtype())));
    }
    Ok(x.f64s())
}

/// For every (kernel position, output position) of a convolution or pooling window, in that
/// order: the input offset it reads, or `None` in the padding.
pub(crate) fn window_offsets(
    in_sp: &[usize],
    kernel: &[usize],
    pads: &[usize],
    strides: &[usize],
    dilations: &[usize],
    out: &[usize],
) -> Vec<Option<usize>> {
    let (kvol, ovol): (usize, usize) = (kernel.iter().product(), out.iter().product());
    let (kst, ost, ist) = (shape::strides(kernel), shape::strides(out), shape::strides(in_sp));
    let mut src = Vec::with_capacity(kvol * ovol);
    for kp in 0..kvol {
        for op in 0..ovol {
            let mut off = 0usize;
            let mut inside = true;
            for d in 0..kernel.len() {
                let kc = (kp / kst[d]) % kernel[d];
                let oc = (op / ost[d]) % out[d];
                let ic = (oc * strides[d] + kc * dilations[d]) as i64 - pads[d] as i64;
                if ic < 0 || ic >= in_sp[d] as i64 {
                    inside = false;
                    break;
                }
                off += ic as usize * ist[d];
            }
            src.push(inside.then_some(off));
        }
    }
    src
}

fn ints(t: Option<&HostTensor>, what: &str) -> Res<Vec<i64>> {
    t.ok_or_else(|| err(format!("missing {what}")))?.i64s().ok_or_else(|| err(format!("{what} must be integers")))
}

fn axis(a: i64, rank: usize) -> Res<usize> {
    normalize_axis(a, rank).ok_or_else(|| err(format!("axis {a} out of range for rank {rank}")))
}

/// Output spatial sizes and begin/end pads (`[begin..., end...]`) of a convolution or pooling
/// window over the spatial sizes `in_sp`.
fn window(in_sp: &[usize], spec: &WindowSpec) -> Res<(Vec<usize>, Vec<usize>)> {
    let w = spec.resolve(in_sp).map_err(err)?;
    Ok((w.out, [w.pads_begin, w.pads_end].concat()))
}

/// A weight's spatial dims as a window's kernel.
fn kernel_of(w: &HostTensor) -> Vec<i64> {
    w.shape.get(2..).unwrap_or_default().iter().map(|&k| k as i64).collect()
}

fn conv(x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>, a: &ConvAttrs) -> Res<HostTensor> {
    if x.dtype() == DType::F64 {
        return train::conv_f64(x, w, b, a);
    }
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let (out, pads) = window(&x.shape[2..], &a.window(&kernel_of(w)))?;
    let us = |v: &[i64], n: usize| (0..n).map(|i| v.get(i).copied().unwrap_or(1) as usize).collect::<Vec<_>>();
    let sp = kernel.len();
    linalg::conv(x, w, b, &pads[..sp], &us(&a.strides, sp), &us(&a.dilations, sp), a.group as usize, &out)
}

fn pool(x: &HostTensor, a: &PoolAttrs, max: bool) -> Res<HostTensor> {
    let kernel: Vec<usize> = a.kernel_shape.iter().map(|&k| k as usize).collect();
    let (out, pads) = window(&x.shape[2..], &a.window())?;
    let sp = kernel.len();
    let us = |v: &[i64]| (0..sp).map(|i| v.get(i).copied().unwrap_or(1) as usize).collect::<Vec<_>>();
    nn::pool(x, &kernel, &pads, &us(&a.strides), &us(&a.dilations), &out, max, a.count_include_pad)
}

fn reduce_axes(x: &HostTensor, axes: Option<&HostTensor>, noop: bool) -> Res<Option<Vec<usize>>> {
    let axes = match axes.map(|a| a.i64s()) {
        Some(None) => return Err(err("axes must be integers")),
        a => a.flatten(),
    };
    mpc_ir::geometry::reduce_axes(axes.as_deref(), x.shape.len(), noop).map_err(err)
}

/// `x` with its last two axes swapped (a tensor of rank 2 or more): what a launch reads of an
/// [`crate::program::Operand::Transposed`] operand.
pub(crate) fn swap_last_two(x: &HostTensor) -> HostTensor {
    let r = x.shape.len();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    shape::transpose(x, &perm)
}

/// `x` with axis `i` its axis `perm[i]`: what a launch reads of an
/// [`crate::program::Operand::Permuted`] operand.
pub(crate) fn permute(x: &HostTensor, perm: &[usize]) -> HostTensor {
    shape::transpose(x, perm)
}

/// Runs one op on host tensors. `n_outputs` is how many outputs the node declares.
fn unary(op: &Op, a: &HostTensor) -> Res<Vec<HostTensor>> {
    let r = if a.dtype().is_float() { elementwise::unary(op, a) } else { elementwise::unary_int(op, a) };
    Ok(vec![r.ok_or_else(|| unsupported(format!("{} on {}", op.op_type(), a.dtype())))?])
}

/// [`run_op_within`] the default limit: what mpc addresses, within the machine's memory.
pub fn run_op(op: &Op, ins: &[Option<&HostTensor>], n_outputs: usize) -> Res<Vec<HostTensor>> {
    run_op_within(op, ins, n_outputs, crate::device::DeviceOptions::default().memory())
}

/// One op's call on the CPU: its inputs, the outputs wanted, and the most bytes an output whose
/// shape comes from data may take.
#[derive(Clone, Copy)]
struct Call<'a> {
    op: &'a Op,
    ins: &'a [Option<&'a HostTensor>],
    n_outputs: usize,
    limit: u64,
}

impl<'a> Call<'a> {
    /// Input `i`, which must be given.
    fn x(&self, i: usize) -> Res<&'a HostTensor> {
        self.ins.get(i).copied().flatten().ok_or_else(|| err(format!("missing input {i}")))
    }
}

/// One output.
fn one(t: HostTensor) -> Res<Vec<HostTensor>> {
    Ok(vec![t])
}

/// Runs `op` on `ins`; an output whose shape comes from data and would be more than `limit`
/// bytes is refused before it is allocated. Each family's ops run in one function.
pub fn run_op_within(op: &Op, ins: &[Option<&HostTensor>], n_outputs: usize, limit: u64) -> Res<Vec<HostTensor>> {
    let call = Call { op, ins, n_outputs, limit };
    match op.kind() {
        Kind::Unary(_)
        | Kind::Arith(_)
        | Kind::Compare(_)
        | Kind::Predicate
        | Kind::Bitwise
        | Kind::Variadic
        | Kind::Select
        | Kind::Cast
        | Kind::ActivationGrad
        | Kind::RowWise => elementwise(call),
        Kind::View | Kind::Shape => view(call),
        Kind::Movement => movement(call),
        Kind::MatMul | Kind::Conv | Kind::Pool | Kind::Norm | Kind::Loss | Kind::Attention => layer(call),
        Kind::Reduce(_) | Kind::Index | Kind::Scan => index(call),
        Kind::Random | Kind::Train | Kind::Collective | Kind::Opaque => other(call),
    }
}

/// The element-wise ops, the softmaxes and the activations' gradients.
fn elementwise(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, .. } = call;
    let x = |i: usize| call.x(i);
    match op {
        mpc_ir::unary_ops!() => unary(op, x(0)?),
        mpc_ir::arith_ops!() => {
            one(elementwise::binary(op, x(0)?, x(1)?).ok_or_else(|| err("inputs do not broadcast"))?)
        }
        Op::Sum | Op::Max | Op::Min | Op::Mean => {
            let fold = if matches!(op, Op::Mean) { Op::Sum } else { op.clone() };
            let mut acc = x(0)?.clone();
            for i in 1..ins.len() {
                acc = elementwise::binary(&fold, &acc, x(i)?).ok_or_else(|| err("inputs do not broadcast"))?;
            }
            if matches!(op, Op::Mean) {
                let n = HostTensor::from_f64(acc.dtype(), vec![], vec![ins.len() as f64]);
                acc = elementwise::binary(&Op::Div, &acc, &n).ok_or_else(|| err("Mean"))?;
            }
            one(acc)
        }
        Op::IsNaN | Op::IsInf(_) => one(elementwise::is_special(op, x(0)?).ok_or_else(|| err("IsNaN/IsInf"))?),
        mpc_ir::compare_ops!() => {
            one(elementwise::compare(op, x(0)?, x(1)?).ok_or_else(|| err("inputs do not broadcast"))?)
        }
        Op::Not => one(elementwise::not(x(0)?).ok_or_else(|| err("Not needs bool input"))?),
        mpc_ir::bitwise_ops!() => {
            let bits = op.bitwise().expect("a bit operation");
            let b = if bits.unary() { None } else { Some(x(1)?) };
            let what = "operands of one integer dtype that broadcast";
            one(elementwise::bitwise(bits, x(0)?, b).ok_or_else(|| err(what))?)
        }
        Op::Where => one(elementwise::where_(x(0)?, x(1)?, x(2)?).ok_or_else(|| err("inputs do not broadcast"))?),
        Op::Clip => one(elementwise::clip(x(0)?, ins.get(1).copied().flatten(), ins.get(2).copied().flatten())?),
        Op::Cast(a) => one(x(0)?.cast(a.to)),
        Op::Softmax(a) | Op::LogSoftmax(a) => {
            let t = x(0)?;
            one(nn::softmax(t, axis(a.axis, t.shape.len())?, matches!(op, Op::LogSoftmax(_)))?)
        }
        Op::GeluGrad(a) => one(train::gelu_grad(x(0)?, x(1)?, a.approximate)?),
        Op::ReluGrad => one(train::relu_grad(x(0)?, x(1)?)?),
        Op::SoftmaxGrad(a) => {
            let y = x(1)?;
            one(train::softmax_grad(x(0)?, y, axis(a.axis, y.shape.len())?)?)
        }
        op => unreachable!("{} is not of the families elementwise runs", op.op_type()),
    }
}

/// The views, shapes and constants.
fn view(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, limit, .. } = call;
    let x = |i: usize| call.x(i);
    match op {
        Op::Identity => unary(op, x(0)?),
        Op::Constant(a) => one(HostTensor::from(&a.value)),
        Op::ConstantOfShape(a) => {
            let shape: Vec<usize> =
                ints(ins.first().copied().flatten(), "shape")?.iter().map(|&d| d.max(0) as usize).collect();
            let value = a
                .value
                .as_ref()
                .map(HostTensor::from)
                .unwrap_or_else(|| HostTensor::from(&Tensor::from_f32(vec![1], &[0.0])));
            fits(&shape, value.dtype(), limit)?;
            let n = shape.iter().product();
            one(value.pick(shape, &vec![0; n]))
        }
        Op::Shape(a) => {
            let r = x(0)?.shape.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let (s, e) = (clamp(a.start), clamp(a.end.unwrap_or(r)));
            let dims: Vec<i64> = x(0)?.shape[s..e.max(s)].iter().map(|&d| d as i64).collect();
            one(HostTensor::from_i64(DType::I64, vec![dims.len()], dims))
        }
        Op::Size => one(HostTensor::from_i64(DType::I64, vec![], vec![x(0)?.len() as i64])),
        Op::Reshape(a) => one(shape::reshape(x(0)?, &ints(ins.get(1).copied().flatten(), "shape")?, a.allowzero)?),
        Op::Flatten(a) => {
            let t = x(0)?;
            let r = t.shape.len() as i64;
            let ax = if a.axis < 0 { a.axis + r } else { a.axis } as usize;
            let ax = ax.min(t.shape.len());
            // Each side's own product: an empty tensor's inner size is not len / outer.
            let (outer, inner) = (t.shape[..ax].iter().product(), t.shape[ax..].iter().product());
            one(t.clone().with_shape(vec![outer, inner]))
        }
        Op::Squeeze => {
            let t = x(0)?;
            let shape: Vec<usize> = match ins.get(1).copied().flatten() {
                Some(a) => {
                    let axes: Vec<usize> =
                        a.i64s().unwrap_or_default().iter().map(|&v| axis(v, t.shape.len())).collect::<Res<_>>()?;
                    if let Some(&a) = axes.iter().find(|&&a| t.shape[a] != 1) {
                        return Err(err(format!("cannot squeeze axis {a} of size {}", t.shape[a])));
                    }
                    t.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect()
                }
                None => t.shape.iter().copied().filter(|&d| d != 1).collect(),
            };
            one(t.clone().with_shape(shape))
        }
        Op::Unsqueeze => {
            let t = x(0)?;
            let r = t.shape.len() + ints(ins.get(1).copied().flatten(), "axes")?.len();
            let mut axes: Vec<usize> =
                ints(ins.get(1).copied().flatten(), "axes")?.iter().map(|&v| axis(v, r)).collect::<Res<_>>()?;
            axes.sort_unstable();
            if axes.windows(2).any(|w| w[0] == w[1]) {
                return Err(err("Unsqueeze axes repeat an axis"));
            }
            let mut dims = t.shape.iter();
            let shape = (0..r).map(|i| if axes.contains(&i) { 1 } else { *dims.next().unwrap_or(&1) }).collect();
            one(t.clone().with_shape(shape))
        }
        Op::Range => one(shape::range(x(0)?, x(1)?, x(2)?, limit)?),
        op => unreachable!("{} is not of the families view runs", op.op_type()),
    }
}

/// Data movement.
fn movement(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, n_outputs, limit } = call;
    let x = |i: usize| call.x(i);
    match op {
        Op::Trilu(a) => {
            let k = match ins.get(1).copied().flatten() {
                Some(t) => t.i64s().and_then(|v| v.first().copied()).unwrap_or(0),
                None => 0,
            };
            one(shape::trilu(x(0)?, k, a.upper)?)
        }
        Op::Transpose(a) => {
            let t = x(0)?;
            let perm: Vec<usize> = match &a.perm {
                Some(p) => p.iter().map(|&d| axis(d, t.shape.len())).collect::<Res<_>>()?,
                None => (0..t.shape.len()).rev().collect(),
            };
            one(shape::transpose(t, &perm))
        }
        Op::Concat(a) => {
            let parts: Vec<&HostTensor> = ins.iter().flatten().copied().collect();
            one(shape::concat(&parts, a.axis)?)
        }
        Op::Split(a) => {
            let t = x(0)?;
            let ax = axis(a.axis, t.shape.len())?;
            let len = t.shape[ax];
            let sizes: Vec<usize> = match ins.get(1).copied().flatten() {
                Some(s) => s.i64s().unwrap_or_default().iter().map(|&v| v.max(0) as usize).collect(),
                None => {
                    if let Some(k) = a.num_outputs.filter(|&k| k != n_outputs as i64) {
                        return Err(err(format!("Split: num_outputs is {k} but the node has {n_outputs} outputs")));
                    }
                    let parts = n_outputs.max(1);
                    let chunk = len.div_ceil(parts);
                    (0..parts).map(|i| chunk.min(len.saturating_sub(i * chunk))).collect()
                }
            };
            let mut start = 0i64;
            sizes
                .iter()
                .map(|&s| {
                    let r = shape::slice(t, &[start], &[start + s as i64], &[ax as i64], &[1]);
                    start += s as i64;
                    r
                })
                .collect()
        }
        Op::Slice => {
            let t = x(0)?;
            let starts = ints(ins.get(1).copied().flatten(), "starts")?;
            let ends = ints(ins.get(2).copied().flatten(), "ends")?;
            let axes = match ins.get(3).copied().flatten() {
                Some(a) => a.i64s().unwrap_or_default(),
                None => (0..starts.len() as i64).collect(),
            };
            let steps = match ins.get(4).copied().flatten() {
                Some(s) => s.i64s().unwrap_or_default(),
                None => vec![1; starts.len()],
            };
            one(shape::slice(t, &starts, &ends, &axes, &steps)?)
        }
        Op::Expand => one(shape::expand(x(0)?, &ints(ins.get(1).copied().flatten(), "shape")?, limit)?),
        Op::Tile => one(shape::tile(x(0)?, &ints(ins.get(1).copied().flatten(), "repeats")?, limit)?),
        Op::Pad(a) => {
            let t = x(0)?;
            let pads = ints(ins.get(1).copied().flatten(), "pads")?;
            let axes: Vec<usize> = match ins.get(3).copied().flatten() {
                Some(ax) => {
                    ax.i64s().unwrap_or_default().iter().map(|&v| axis(v, t.shape.len())).collect::<Res<_>>()?
                }
                None => (0..t.shape.len()).collect(),
            };
            one(shape::pad(t, &pads, ins.get(2).copied().flatten(), &axes, a.mode, limit)?)
        }
        Op::Resize(a) => {
            let at = |i: usize| ins.get(i).copied().flatten();
            one(resize::resize(x(0)?, at(1), at(2), at(3), a)?)
        }
        op => unreachable!("{} is not of the families movement runs", op.op_type()),
    }
}

/// The layers: products, convolutions, pools, normalisations and losses (and their gradients).
fn layer(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, n_outputs, limit } = call;
    let x = |i: usize| call.x(i);
    match op {
        Op::MatMul => one(linalg::matmul(x(0)?, x(1)?)?),
        Op::Gemm(a) => {
            one(linalg::gemm(x(0)?, x(1)?, ins.get(2).copied().flatten(), a.alpha, a.beta, a.transA, a.transB)?)
        }
        Op::Conv(a) => one(conv(x(0)?, x(1)?, ins.get(2).copied().flatten(), a)?),
        Op::MaxPool(a) if n_outputs == 1 => one(pool(x(0)?, a, true)?),
        Op::AveragePool(a) => one(pool(x(0)?, a, false)?),
        Op::GlobalAveragePool | Op::GlobalMaxPool => {
            let t = x(0)?;
            let axes: Vec<usize> = (2..t.shape.len()).collect();
            let kind = if matches!(op, Op::GlobalMaxPool) {
                mpc_ir::ops::ReduceKind::Max
            } else {
                mpc_ir::ops::ReduceKind::Mean
            };
            one(nn::reduce(t, &axes, true, kind, limit)?)
        }
        Op::LayerNormalization(a) => {
            let t = x(0)?;
            let out = nn::layer_norm(t, x(1)?, ins.get(2).copied().flatten(), axis(a.axis, t.shape.len())?, a.epsilon)?;
            Ok(out.into_iter().take(n_outputs.max(1)).collect())
        }
        Op::BatchNormalization(a) => {
            let out = nn::batch_norm(x(0)?, x(1)?, x(2)?, x(3)?, x(4)?, a.epsilon, a.momentum, a.training_mode)?;
            Ok(out.into_iter().take(n_outputs.max(1)).collect())
        }
        Op::InstanceNormalization(a) => one(nn::instance_norm(x(0)?, x(1)?, x(2)?, a.epsilon)?),
        Op::NegativeLogLikelihoodLoss(a) => {
            one(nn::nll_loss(x(0)?, x(1)?, ins.get(2).copied().flatten(), a.ignore_index, a.reduction)?)
        }
        Op::SoftmaxCrossEntropyLoss(a) => {
            // log_prob = LogSoftmax over the class axis, then NLL.
            let log_prob = nn::softmax(x(0)?, 1, true)?;
            let loss = nn::nll_loss(&log_prob, x(1)?, ins.get(2).copied().flatten(), a.ignore_index, a.reduction)?;
            Ok(if n_outputs > 1 { vec![loss, log_prob] } else { vec![loss] })
        }
        Op::MaxPool(a) => {
            let t = x(0)?;
            let (out, pads) = window(&t.shape[2..], &a.window())?;
            extra::max_pool_with_indices(t, a, &out, &pads)
        }
        Op::ConvTranspose(a) => one(extra::conv_transpose(x(0)?, x(1)?, ins.get(2).copied().flatten(), a)?),
        Op::GroupNormalization(a) => one(extra::group_norm(x(0)?, x(1)?, x(2)?, a.num_groups as usize, a.epsilon)?),
        Op::LRN(a) => one(extra::lrn(x(0)?, a.size as usize, a.alpha, a.beta, a.bias)?),
        Op::Einsum(a) => {
            let parts: Vec<&HostTensor> = ins.iter().flatten().copied().collect();
            one(extra::einsum(&a.equation, &parts)?)
        }
        // ---- ai.mpc: training graphs ----
        // (dX, dW) where the node has no dB output.
        Op::ConvGrad(a) => train::conv_grad(x(0)?, x(1)?, x(2)?, a).map(|mut outs| {
            outs.truncate(n_outputs.max(1));
            outs
        }),
        Op::MaxPoolGrad(a) => one(train::pool_grad(x(0)?, x(1)?, a, true)?),
        Op::AveragePoolGrad(a) => one(train::pool_grad(x(0)?, x(1)?, a, false)?),
        Op::BatchNormalizationGrad(a) => train::batch_norm_grad(x(0)?, x(1)?, x(2)?, a.epsilon),
        Op::LayerNormalizationGrad(a) => {
            let t = x(1)?;
            train::layer_norm_grad(x(0)?, t, x(2)?, axis(a.axis, t.shape.len())?, a.epsilon)
        }
        Op::SoftmaxCrossEntropyLossGrad(a) | Op::NegativeLogLikelihoodLossGrad(a) => {
            let softmax = matches!(op, Op::SoftmaxCrossEntropyLossGrad(_));
            let w = ins.get(3).copied().flatten();
            one(train::loss_grad(x(0)?, x(1)?, x(2)?, w, a.ignore_index, a.reduction, softmax)?)
        }
        Op::Attention(_) | Op::AttentionGrad(_) => attention::run(op, ins),
        op => unreachable!("{} is not of the families layer runs", op.op_type()),
    }
}

/// The reductions, scans, gathers, scatters, top-k, arg-max/min and RoiAlign.
fn index(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, limit, .. } = call;
    let x = |i: usize| call.x(i);
    match op {
        Op::Gather(a) => one(shape::gather(x(0)?, x(1)?, a.axis)?),
        Op::GatherElements(a) => one(indexing::gather_elements(x(0)?, x(1)?, a.axis)?),
        Op::GatherND(a) => one(indexing::gather_nd(x(0)?, x(1)?, a.batch_dims)?),
        Op::ScatterND(a) => one(indexing::scatter_nd(x(0)?, x(1)?, x(2)?, a.reduction)?),
        Op::ScatterElements(a) => one(indexing::scatter_elements(x(0)?, x(1)?, x(2)?, a.axis, a.reduction)?),
        mpc_ir::reduce_ops!() => {
            let (kind, a) = op.reduction().ok_or_else(|| err(format!("{} is not a reduction", op.op_type())))?;
            let t = x(0)?;
            match reduce_axes(t, ins.get(1).copied().flatten(), a.noop_with_empty_axes)? {
                // No axes with noop_with_empty_axes: nothing is reduced, but the op's element-wise
                // part still applies (|x|, x², |x|; the identity for the others).
                None if kind.applies_elementwise() => one(nn::reduce(t, &[], a.keepdims, kind, limit)?),
                None => one(t.clone()),
                Some(axes) => one(nn::reduce(t, &axes, a.keepdims, kind, limit)?),
            }
        }
        Op::ArgMax(a) | Op::ArgMin(a) => {
            let t = x(0)?;
            let min = matches!(op, Op::ArgMin(_));
            one(nn::argmax(t, axis(a.axis, t.shape.len())?, a.keepdims, a.select_last_index, min)?)
        }
        Op::TopK(a) => {
            let t = x(0)?;
            let k = match ints(ins.get(1).copied().flatten(), "k")?[..] {
                [k] if k >= 0 => k as usize,
                ref v => return Err(err(format!("k must be one value of at least 0, not {v:?}"))),
            };
            nn::top_k(t, axis(a.axis, t.shape.len())?, k, a.largest)
        }
        Op::CumSum(a) | Op::CumProd(a) => {
            let t = x(0)?;
            let ax = match ints(ins.get(1).copied().flatten(), "axis")?[..] {
                [a] => a,
                ref v => return Err(err(format!("the axis must hold one value, not {}", v.len()))),
            };
            one(nn::cumulative(t, axis(ax, t.shape.len())?, a, matches!(op, Op::CumProd(_)))?)
        }
        Op::RoiAlign(a) => one(roi_align::roi_align(x(0)?, x(1)?, x(2)?, a)?),
        Op::RoiAlignGrad(a) => one(roi_align::roi_align_grad(x(0)?, x(1)?, x(2)?, x(3)?, a)?),
        Op::CumProdGrad(a) => {
            let t = x(1)?;
            let ax = match ints(ins.get(2).copied().flatten(), "axis")?[..] {
                [a] => a,
                ref v => return Err(err(format!("the axis must hold one value, not {}", v.len()))),
            };
            one(nn::cumprod_grad(x(0)?, t, axis(ax, t.shape.len())?, a)?)
        }
        Op::GatherGrad(a) => one(train::gather_grad(x(0)?, x(1)?, x(2)?, a.axis)?),
        op => unreachable!("{} is not of the families index runs", op.op_type()),
    }
}

/// Dropout, the optimizer's ops, the collectives and opaque ops.
fn other(call: Call) -> Res<Vec<HostTensor>> {
    let Call { op, ins, n_outputs, .. } = call;
    let x = |i: usize| call.x(i);
    match op {
        Op::Dropout(_) => {
            if let Some(t) = ins.get(2).copied().flatten() {
                if t.i64s().is_some_and(|v| v.first() == Some(&1)) {
                    return Err(unsupported("Dropout in training mode"));
                }
            }
            let a = x(0)?.clone();
            let mut out = vec![a.clone()];
            if n_outputs > 1 {
                out.push(HostTensor { shape: a.shape.clone(), data: Data::Bool(vec![true; a.len()].into()) });
            }
            Ok(out)
        }
        // onnxruntime's contrib Gelu (com.microsoft) is the standard erf Gelu.
        Op::Opaque(o) if o.domain == "com.microsoft" && o.op_type == "Gelu" && o.attrs.is_empty() => {
            let gelu = Op::Gelu(Default::default());
            one(elementwise::unary(&gelu, x(0)?).ok_or_else(|| {
                unsupported(format!("Gelu on {}", x(0).map(|t| t.dtype().to_string()).unwrap_or_default()))
            })?)
        }
        Op::Opaque(o) => Err(unsupported(format!("opaque op {}::{} cannot run", o.domain, o.op_type))),
        // One rank alone: every reduction of one tensor is that tensor. A device with a group of
        // ranks runs the op through its collective instead (`CpuDevice::launch_one`).
        Op::AllReduce(_) => one(x(0)?.clone()),
        Op::ReduceScatter(a) if a.world == 1 => one(x(0)?.clone()),
        Op::AllGather(a) if a.world == 1 => one(x(0)?.clone()),
        Op::ReduceScatter(a) => Err(err(format!("a shard of {} ranks on a device of one rank", a.world))),
        Op::AllGather(a) => Err(err(format!("a gather over {} ranks on a device of one rank", a.world))),
        Op::AllFinite => {
            let parts: Vec<&HostTensor> = ins.iter().flatten().copied().collect();
            one(train::all_finite(&parts)?)
        }
        Op::SgdUpdate(a) => {
            let g = train::unscaled(x(0)?, x(1)?, ins.get(4).copied().flatten(), "SgdUpdate")?;
            let a = SgdAttrs { lr: train::rate_of(ins.get(6).copied().flatten(), a.lr)?, ..(**a).clone() };
            let outs = train::sgd_update(&[x(0)?, &g, x(2)?], ins.get(3).copied().flatten(), &a)?;
            train::with_low_copy(outs, ins.get(5).copied().flatten(), x(2)?)
        }
        Op::AdamUpdate(a) => {
            let g = train::unscaled(x(0)?, x(1)?, ins.get(6).copied().flatten(), "AdamUpdate")?;
            let a = AdamAttrs { lr: train::rate_of(ins.get(8).copied().flatten(), a.lr)?, ..(**a).clone() };
            let outs = train::adam_update(&[x(0)?, &g, x(2)?, x(3)?, x(4)?, x(5)?], &a)?;
            train::with_low_copy(outs, ins.get(7).copied().flatten(), x(5)?)
        }
        Op::LossScaleUpdate(a) => train::loss_scale_update(x(0)?, x(1)?, x(2)?, a),
        Op::LrSchedule(a) => train::lr_schedule(x(0)?, x(1)?, a),
        Op::SeededDropout(a) => {
            let (out, mask) = train::seeded_dropout(x(0)?, ins.get(1).copied().flatten(), x(2)?, a.seed)?;
            Ok(if n_outputs > 1 { vec![out, mask] } else { vec![out] })
        }
        op => unreachable!("{} is not of the families other runs", op.op_type()),
    }
}
