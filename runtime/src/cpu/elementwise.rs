//! Element-wise ops with numpy broadcasting. Floats compute in f32 (f32, f16, bf16: rounded on
//! store) or f64; integer arithmetic in i64, stored back in the input's dtype.

use mpc_ir::ops::{Bitwise, IntegerUnary, Unary};
use mpc_ir::real::{max, min};
use mpc_ir::Op;

use super::{err, Res};
use crate::value::{Data, HostTensor};

pub use mpc_ir::real::Real;

/// [`Unary::eval`] over a slice, with the op resolved once (the common ones get loops of their
/// own, the formula inlined for a constant op); `None` is the identity (Identity, inference
/// Dropout).
fn map_unary<R: Real>(u: Option<(Unary, [f32; 2])>, v: &[R]) -> Vec<R> {
    use Unary::*;
    let each = |u: Unary, p| v.iter().map(|&a| u.eval(p, a)).collect();
    match u {
        None => v.to_vec(),
        Some((Relu, p)) => each(Relu, p),
        Some((Neg, p)) => each(Neg, p),
        Some((Exp, p)) => each(Exp, p),
        Some((Sqrt, p)) => each(Sqrt, p),
        Some((Tanh, p)) => each(Tanh, p),
        Some((Erf, p)) => each(Erf, p),
        Some((GeluTanh, p)) => each(GeluTanh, p),
        Some((Gelu, p)) => each(Gelu, p),
        Some((u, p)) => each(u, p),
    }
}

/// The op of a unary kernel: its [`Unary`], or `None` for the identity; not one: `Err`.
fn unary_of(op: &Op) -> Result<Option<(Unary, [f32; 2])>, ()> {
    match op {
        Op::Identity | Op::Dropout(_) => Ok(None),
        op => op.unary().map(Some).ok_or(()),
    }
}

/// Applies a float unary op, computing in f32 (or f64) and storing in the input's dtype.
pub(crate) fn unary(op: &Op, x: &HostTensor) -> Option<HostTensor> {
    let u = unary_of(op).ok()?;
    let shape = x.shape.clone();
    match &x.data {
        Data::F32(v) => Some(HostTensor { shape, data: Data::F32(map_unary(u, v).into()) }),
        Data::F64(v) => Some(HostTensor { shape, data: Data::F64(map_unary(u, v).into()) }),
        _ => Some(HostTensor::from_f32(x.dtype(), shape, map_unary(u, &x.f32s()?))),
    }
}

/// Integer unary ops ([`Unary::on_integers`] and the pass-throughs).
pub(crate) fn unary_int(op: &Op, x: &HostTensor) -> Option<HostTensor> {
    let v = x.i64s()?;
    let u = unary_of(op).ok()?;
    let out: Vec<i64> = match u.map(|(u, _)| (u, u.on_integers())) {
        None | Some((_, Some(IntegerUnary::Keeps))) => v,
        Some((Unary::Neg, _)) => v.iter().map(|&a| a.wrapping_neg()).collect(),
        Some((Unary::Abs, _)) => v.iter().map(|&a| a.wrapping_abs()).collect(),
        Some((Unary::Relu, _)) => v.iter().map(|&a| a.max(0)).collect(),
        Some((Unary::Sign, _)) => v.iter().map(|&a| a.signum()).collect(),
        Some(_) => return None,
    };
    Some(HostTensor::from_i64(x.dtype(), x.shape.clone(), out))
}

pub(crate) use mpc_ir::geometry::broadcast_shape;

/// For every output position, the flat index into an input of shape `shape` broadcast to `out`.
pub(crate) fn broadcast_index(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let n: usize = out.iter().product();
    if shape == out {
        return (0..n).collect();
    }
    let rank = out.len();
    let strides = mpc_ir::geometry::broadcast_strides(shape, out);
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; rank];
    let mut pos = 0usize;
    for _ in 0..n {
        idx.push(pos);
        for d in (0..rank).rev() {
            counter[d] += 1;
            pos += strides[d];
            if counter[d] < out[d] {
                break;
            }
            pos -= strides[d] * counter[d];
            counter[d] = 0;
        }
    }
    idx
}

fn int_bin(op: &Op, a: i64, b: i64) -> Option<i64> {
    Some(match op {
        Op::Add | Op::Sum => a.wrapping_add(b),
        Op::Sub => a.wrapping_sub(b),
        Op::Mul => a.wrapping_mul(b),
        Op::Div => {
            if b == 0 {
                0
            } else {
                a.wrapping_div(b)
            }
        }
        Op::Max => a.max(b),
        Op::Min => a.min(b),
        Op::Pow => (a as f64).powf(b as f64) as i64,
        Op::Mod(m) if b != 0 && m.fmod => a.wrapping_rem(b),
        Op::Mod(_) if b != 0 => {
            let r = a.wrapping_rem(b);
            if r != 0 && (r < 0) != (b < 0) {
                r + b
            } else {
                r
            }
        }
        Op::Mod(_) => 0,
        _ => return None,
    })
}

/// The float function of a binary op, resolved once per call rather than per element.
fn float_fn<R: Real>(op: &Op) -> Option<fn(R, R) -> R> {
    Some(match op {
        Op::Add | Op::Sum => |a, b| a + b,
        Op::Sub => |a, b| a - b,
        Op::Mul => |a, b| a * b,
        Op::Div => |a, b| a / b,
        Op::Pow => |a: R, b| a.powf(b),
        Op::Max => max,
        Op::Min => min,
        Op::PRelu => |a: R, b| if a < R::of(0.0) { a * b } else { a },
        Op::Mod(m) if m.fmod => |a: R, b| a.fmod(b),
        // numpy's mod: the remainder takes the divisor's sign (also right for infinite divisors).
        Op::Mod(_) => |a: R, b: R| {
            let r = a.fmod(b);
            if r != R::of(0.0) && (r < R::of(0.0)) != (b < R::of(0.0)) {
                r + b
            } else {
                r
            }
        },
        _ => return None,
    })
}

/// `f` over two operands broadcast to `out`, with fast paths for the common layouts.
fn zip_broadcast<T: Copy, U: Copy, V>(
    a: &[T],
    ash: &[usize],
    b: &[U],
    bsh: &[usize],
    out: &[usize],
    f: impl Fn(T, U) -> V,
) -> Vec<V> {
    let n: usize = out.iter().product();
    let suffix = |sh: &[usize]| sh.len() <= out.len() && sh == &out[out.len() - sh.len()..];
    if ash == out && bsh == out {
        a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
    } else if ash == out && b.len() == 1 {
        a.iter().map(|&x| f(x, b[0])).collect()
    } else if bsh == out && a.len() == 1 {
        b.iter().map(|&y| f(a[0], y)).collect()
    } else if ash == out && suffix(bsh) && !b.is_empty() {
        // `b` repeats along `a`'s rows: one pass per row, without an index division per element.
        a.chunks_exact(b.len()).flat_map(|row| row.iter().zip(b).map(|(&x, &y)| f(x, y))).collect()
    } else if bsh == out && suffix(ash) && !a.is_empty() {
        b.chunks_exact(a.len()).flat_map(|row| a.iter().zip(row).map(|(&x, &y)| f(x, y))).collect()
    } else {
        let (ia, ib) = (broadcast_index(ash, out), broadcast_index(bsh, out));
        (0..n).map(|k| f(a[ia[k]], b[ib[k]])).collect()
    }
}

/// Runs `zip_broadcast` with the op's function written inline in each arm, so that every op gets
/// its own loop (a function pointer per element would block inlining and vectorisation).
macro_rules! float_arms {
    ($op:expr, $R:ty, |$f:ident| $call:expr) => {
        match $op {
            Op::Add | Op::Sum => {
                let $f = |a: $R, b: $R| a + b;
                Some($call)
            }
            Op::Sub => {
                let $f = |a: $R, b: $R| a - b;
                Some($call)
            }
            Op::Mul => {
                let $f = |a: $R, b: $R| a * b;
                Some($call)
            }
            Op::Div => {
                let $f = |a: $R, b: $R| a / b;
                Some($call)
            }
            op => float_fn::<$R>(op).map(|g| {
                let $f = g;
                $call
            }),
        }
    };
}

/// A binary arithmetic op with broadcasting; the output has `a`'s dtype.
pub(crate) fn binary(op: &Op, a: &HostTensor, b: &HostTensor) -> Option<HostTensor> {
    let shape = broadcast_shape(&[&a.shape, &b.shape])?;
    match (&a.data, a.dtype()) {
        (Data::F64(x), _) => {
            let y = b.f64s();
            let out = float_arms!(op, f64, |f| zip_broadcast(x, &a.shape, &y, &b.shape, &shape, f))?;
            Some(HostTensor { data: Data::F64(out.into()), shape })
        }
        (Data::F32(x), _) => {
            let owned;
            let y: &[f32] = match &b.data {
                Data::F32(y) => y,
                // Pow's exponent may be of another type; read it through f64.
                _ => {
                    owned = b.f64s().into_iter().map(|v| v as f32).collect::<Vec<_>>();
                    &owned
                }
            };
            let out = float_arms!(op, f32, |f| zip_broadcast(x, &a.shape, y, &b.shape, &shape, f))?;
            Some(HostTensor { data: Data::F32(out.into()), shape })
        }
        (_, d) if d.is_float() => {
            let x = a.f32s()?;
            let y: Vec<f32> = b.f32s().unwrap_or_else(|| b.f64s().into_iter().map(|v| v as f32).collect());
            let out = float_arms!(op, f32, |f| zip_broadcast(&x, &a.shape, &y, &b.shape, &shape, f))?;
            Some(HostTensor::from_f32(d, shape, out))
        }
        (_, d) => {
            let (x, y) = (a.i64s()?, b.i64s().unwrap_or_else(|| b.f64s().into_iter().map(|v| v as i64).collect()));
            int_bin(op, 0, 1)?;
            let out = zip_broadcast(&x, &a.shape, &y, &b.shape, &shape, |p, q| int_bin(op, p, q).unwrap_or(0));
            Some(HostTensor::from_i64(d, shape, out))
        }
    }
}

/// A [`Bitwise`] op (`b` is `None` for BitwiseNot): the operands read as i64, each element by
/// the one formula, truncated to `a`'s dtype on store.
pub(crate) fn bitwise(bits: Bitwise, a: &HostTensor, b: Option<&HostTensor>) -> Option<HostTensor> {
    let (d, x) = (a.dtype(), a.i64s()?);
    if !bits.accepts(d) || b.is_some_and(|b| b.dtype() != d) {
        return None;
    }
    let (shape, out) = match b {
        None => (a.shape.clone(), x.into_iter().map(|v| bits.eval(d, v, 0)).collect()),
        Some(b) => {
            let shape = broadcast_shape(&[&a.shape, &b.shape])?;
            let out = zip_broadcast(&x, &a.shape, &b.i64s()?, &b.shape, &shape, |p, q| bits.eval(d, p, q));
            (shape, out)
        }
    };
    Some(HostTensor::from_i64(d, shape, out))
}

/// Equal, Less, Greater, And, Or: bool output.
pub(crate) fn compare(op: &Op, a: &HostTensor, b: &HostTensor) -> Option<HostTensor> {
    let shape = broadcast_shape(&[&a.shape, &b.shape])?;
    let (ia, ib) = (broadcast_index(&a.shape, &shape), broadcast_index(&b.shape, &shape));
    let out: Vec<bool> = match (a.i64s(), b.i64s()) {
        (Some(x), Some(y)) if !a.dtype().is_float() => ia
            .iter()
            .zip(&ib)
            .map(|(&i, &j)| match op {
                Op::Equal => x[i] == y[j],
                Op::Less => x[i] < y[j],
                Op::Greater => x[i] > y[j],
                Op::GreaterOrEqual => x[i] >= y[j],
                Op::LessOrEqual => x[i] <= y[j],
                Op::And => x[i] != 0 && y[j] != 0,
                Op::Or => x[i] != 0 || y[j] != 0,
                Op::Xor => (x[i] != 0) != (y[j] != 0),
                _ => false,
            })
            .collect(),
        _ => {
            let (x, y) = (a.f64s(), b.f64s());
            ia.iter()
                .zip(&ib)
                .map(|(&i, &j)| match op {
                    Op::Equal => x[i] == y[j],
                    Op::Less => x[i] < y[j],
                    Op::Greater => x[i] > y[j],
                    Op::GreaterOrEqual => x[i] >= y[j],
                    Op::LessOrEqual => x[i] <= y[j],
                    _ => false,
                })
                .collect()
        }
    };
    Some(HostTensor { shape, data: Data::Bool(out.into()) })
}

/// Where(cond, x, y).
pub(crate) fn where_(c: &HostTensor, x: &HostTensor, y: &HostTensor) -> Option<HostTensor> {
    let shape = broadcast_shape(&[&c.shape, &x.shape, &y.shape])?;
    let cond = c.i64s()?;
    let (ic, ix, iy) =
        (broadcast_index(&c.shape, &shape), broadcast_index(&x.shape, &shape), broadcast_index(&y.shape, &shape));
    // Pick from x or y by building a joint index into [x ++ y].
    let joined = crate::value::gather_runs(&[x, y], vec![x.len() + y.len()], &[(0, 0, x.len()), (1, 0, y.len())]);
    let idx: Vec<usize> = (0..ic.len()).map(|k| if cond[ic[k]] != 0 { ix[k] } else { x.len() + iy[k] }).collect();
    Some(joined.pick(shape, &idx))
}

/// Clip(x, min, max), either bound optional; a bound must hold one value (its shape may come
/// from data: a Range's length).
pub(crate) fn clip(x: &HostTensor, lo: Option<&HostTensor>, hi: Option<&HostTensor>) -> Res<HostTensor> {
    let bound = |t: Option<&HostTensor>, what: &str| match t.map(|t| t.f64s()) {
        Some(v) if v.len() != 1 => Err(err(format!("Clip's {what} holds {} values, not one", v.len()))),
        v => Ok(v.map(|v| v[0])),
    };
    let (lo, hi) = (bound(lo, "min")?, bound(hi, "max")?);
    if x.dtype().is_float() {
        let v = x.f64s();
        // An absent bound is the dtype's lowest or largest finite value (the spec's default: an
        // infinity becomes it, as in onnxruntime); NaN in is NaN out (f64::max would return the bound).
        let big = x.dtype().finite_max();
        let (lo, hi) = (lo.unwrap_or(-big), hi.unwrap_or(big));
        let clamp = |a: f64| if a.is_nan() { a } else { a.max(lo).min(hi) };
        let out: Vec<f64> = v.into_iter().map(clamp).collect();
        Ok(HostTensor::from_f64(x.dtype(), x.shape.clone(), out))
    } else {
        let v = x.i64s().ok_or_else(|| err(format!("Clip on {}", x.dtype())))?;
        let out = v
            .into_iter()
            .map(|a| a.max(lo.map_or(i64::MIN, |l| l as i64)).min(hi.map_or(i64::MAX, |h| h as i64)))
            .collect();
        Ok(HostTensor::from_i64(x.dtype(), x.shape.clone(), out))
    }
}

/// IsNaN, IsInf (with its sign filters): bool output.
pub(crate) fn is_special(op: &Op, x: &HostTensor) -> Option<HostTensor> {
    let v = x.f64s();
    let out = match op {
        Op::IsNaN => v.iter().map(|a| a.is_nan()).collect(),
        Op::IsInf(a) => v
            .iter()
            .map(|&x| (x == f64::INFINITY && a.detect_positive) || (x == f64::NEG_INFINITY && a.detect_negative))
            .collect(),
        _ => return None,
    };
    Some(HostTensor { shape: x.shape.clone(), data: Data::Bool(out) })
}

/// Not (bool).
pub(crate) fn not(x: &HostTensor) -> Option<HostTensor> {
    match &x.data {
        Data::Bool(v) => Some(HostTensor { shape: x.shape.clone(), data: Data::Bool(v.iter().map(|b| !b).collect()) }),
        _ => None,
    }
}
