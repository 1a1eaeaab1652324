//! Type rules of the neural-network ops' operands and outputs: convolutions and their transposes,
//! pools, the per-channel and per-feature operands of the normalisations, and the losses.

use mpc_ir::ops::{ConvAttrs, PoolAttrs};
use mpc_ir::{Dim, Shape};

use super::rules::NodeCx;

/// The spatial output dims of a window over `x` (batch and channel dims first).
fn spatial(x: &Shape, w: &mpc_ir::geometry::WindowSpec) -> Result<Vec<Dim>, String> {
    let sp = w.kernel.len();
    if x.rank() != sp + 2 {
        return Err(format!("input {x} does not match a {sp}-D kernel"));
    }
    w.out_dims(&x.0[2..])
}

pub(super) fn conv(cx: &NodeCx, a: &ConvAttrs) -> Result<Option<Shape>, String> {
    let (Some(x), Some(w)) = (cx.sh(0), cx.sh(1)) else {
        return Ok(None);
    };
    if w.rank() != x.rank() || x.rank() < 3 {
        return Err(format!("weight {w} and input {x} must have one rank, 3 or more (batch, channels, spatial...)"));
    }
    bias_of(cx, w.0[0].fixed())?;
    kernel_matches(a, w)?;
    if let (Some(c), Some(wc)) = (x.0[1].fixed(), w.0[1].fixed()) {
        // In u128: a declared dim times the group may not fit in u64.
        let want = wc as u128 * a.group as u128;
        if c as u128 != want {
            return Err(format!("input has {c} channels but the weight expects {want} (group {})", a.group));
        }
    }
    let kernel: Vec<i64> = if a.kernel_shape.is_empty() {
        w.0[2..].iter().map(|d| d.fixed().map_or(1, |k| k as i64)).collect()
    } else {
        a.kernel_shape.clone()
    };
    if w.0[2..].iter().any(|d| d.fixed().is_none()) && a.kernel_shape.is_empty() {
        return Ok(Some(Shape(
            vec![x.0[0].clone(), w.0[0].clone()].into_iter().chain(vec![Dim::Unknown; x.rank() - 2]).collect(),
        )));
    }
    let mut out = vec![x.0[0].clone(), w.0[0].clone()];
    out.extend(spatial(x, &a.window(&kernel))?);
    Ok(Some(Shape(out)))
}

pub(super) fn conv_transpose(cx: &NodeCx, a: &ConvAttrs) -> Result<Option<Shape>, String> {
    let (Some(x), Some(w)) = (cx.sh(0), cx.sh(1)) else {
        return Ok(None);
    };
    if w.rank() != x.rank() || x.rank() < 3 {
        return Err(format!("weight {w} and input {x} must have one rank, 3 or more (batch, channels, spatial...)"));
    }
    if let Some(c) = x.0[1].fixed() {
        if w.0[0].fixed().is_some_and(|m| m != c) || c % a.group as u64 != 0 {
            return Err(format!("input has {c} channels; the weight {w} and group {} do not take them", a.group));
        }
    }
    kernel_matches(a, w)?;
    let sp = x.rank() - 2;
    if !a.output_shape.is_empty() && a.output_shape.len() < sp {
        return Err(format!("output_shape {:?} gives fewer than the {sp} spatial dims", a.output_shape));
    }
    for (i, &p) in a.output_padding.iter().enumerate() {
        let (s, d) = (a.strides.get(i).copied().unwrap_or(1), a.dilations.get(i).copied().unwrap_or(1));
        if p >= s.max(d) {
            return Err(format!("output_padding {p} must be less than the stride {s} or the dilation {d}"));
        }
    }
    let cout = w.0[1].fixed().and_then(|c| c.checked_mul(a.group as u64)).map_or(Dim::Unknown, Dim::Fixed);
    bias_of(cx, cout.fixed())?;
    let mut out = vec![x.0[0].clone(), cout];
    if !a.output_shape.is_empty() {
        out.extend(a.output_shape.iter().rev().take(sp).rev().map(|&d| Dim::Fixed(d as u64)));
        return Ok(Some(Shape(out)));
    }
    let kernel: Option<Vec<i64>> =
        (0..sp).map(|i| a.kernel_shape.get(i).copied().or_else(|| w.0.get(i + 2)?.fixed().map(|k| k as i64))).collect();
    let Some(kernel) = kernel else {
        out.extend(vec![Dim::Unknown; sp]);
        return Ok(Some(Shape(out)));
    };
    let spec = a.window(&kernel);
    for i in 0..sp {
        out.push(match x.0[i + 2].fixed() {
            Some(n) => {
                let op = a.output_padding.get(i).copied().unwrap_or(0);
                Dim::Fixed(mpc_ir::geometry::conv_transpose_dim(&spec, i, n, op, None)?.out)
            }
            None => Dim::Unknown,
        });
    }
    Ok(Some(Shape(out)))
}

/// A normalisation's input of at least `min_rank` dims `[batch, channels, ...]` and its
/// per-channel operands (`slots`), one value per channel.
pub(super) fn per_channel(cx: &NodeCx, min_rank: usize, slots: &[(usize, &str)]) -> Result<(), String> {
    let Some(x) = cx.sh(0) else { return Ok(()) };
    if x.rank() < min_rank {
        return Err(format!(
            "the input is {x}, not [batch, channels{}]",
            if min_rank > 2 { ", spatial..." } else { ", ..." }
        ));
    }
    for &(i, what) in slots {
        let Some(s) = cx.sh(i) else { continue };
        let c = x.dims().get(1).and_then(|d| d.fixed());
        let differs = match s.dims() {
            [d] => matches!((d.fixed(), c), (Some(n), Some(c)) if n != c),
            _ => true,
        };
        if differs {
            let want =
                c.map_or("one value per channel".to_string(), |c| format!("the input's {c} channels need [{c}]"));
            return Err(format!("the {what} is {s} where {want}"));
        }
    }
    Ok(())
}

/// A Conv's or ConvTranspose's `kernel_shape`, where given, is the weight's spatial dims.
fn kernel_matches(a: &ConvAttrs, w: &Shape) -> Result<(), String> {
    let spatial = &w.0[2.min(w.rank())..];
    let differs = !a.kernel_shape.is_empty()
        && (a.kernel_shape.len() != spatial.len()
            || a.kernel_shape.iter().zip(spatial).any(|(&k, d)| d.fixed().is_some_and(|d| d as i64 != k)));
    match differs {
        true => Err(format!(
            "kernel_shape {:?} is not the weight's spatial dims {}",
            a.kernel_shape,
            Shape(spatial.to_vec())
        )),
        false => Ok(()),
    }
}

/// A Conv's or ConvTranspose's bias (input 2): one value per output channel. A symbolic length
/// (a bias given as a graph input `[c]`) is checked once the data binds it.
fn bias_of(cx: &NodeCx, channels: Option<u64>) -> Result<(), String> {
    match (cx.sh(2), channels) {
        (Some(b), Some(m)) if b.rank() != 1 || b.dims()[0].fixed().is_some_and(|n| n != m) => {
            Err(format!("bias {b} is not [{m}], one per output channel"))
        }
        _ => Ok(()),
    }
}

/// The per-feature operands (scale, bias) of a normalisation over `x`'s dims from `axis` on: each
/// as many values as those dims hold.
pub(super) fn per_feature(cx: &NodeCx, x: &Shape, axis: usize, slots: &[usize]) -> Result<(), String> {
    let want = x.0[axis..].iter().try_fold(1u64, |acc, d| acc.checked_mul(d.fixed()?));
    for &i in slots {
        let (Some(s), Some(want)) = (cx.sh(i), want) else { continue };
        let have = s.0.iter().try_fold(1u64, |acc, d| acc.checked_mul(d.fixed()?));
        if s.rank() > x.rank() - axis || have.is_some_and(|n| n != want) {
            return Err(format!(
                "input {i} is {s}, not the {want} values of the normalised dims {}",
                Shape(x.0[axis..].to_vec())
            ));
        }
    }
    Ok(())
}

/// The scores `[N, C, d...]`, targets `[N, d...]` and class weights `[C]` of a loss.
pub(super) fn loss_shapes(cx: &NodeCx) -> Result<(), String> {
    let Some(x) = cx.sh(0) else { return Ok(()) };
    if x.rank() < 2 {
        return Err(format!("the scores {x} need rank 2 or more ([batch, classes, ...])"));
    }
    let mut want: Vec<Dim> = x.0.clone();
    let classes = want.remove(1);
    if let Some(t) = cx.sh(1) {
        let differs = t.rank() != want.len()
            || t.0.iter().zip(&want).any(|(a, b)| matches!((a.fixed(), b.fixed()), (Some(p), Some(q)) if p != q));
        if differs {
            return Err(format!("the targets {t} do not match the scores {x} (they must be {})", Shape(want)));
        }
    }
    match (cx.sh(2), classes.fixed()) {
        (Some(w), Some(c)) if w.dims() != [Dim::Fixed(c)] => Err(format!("the class weights {w} are not [{c}]")),
        _ => Ok(()),
    }
}

pub(super) fn pool(cx: &NodeCx, a: &PoolAttrs) -> Result<Option<Shape>, String> {
    let Some(x) = cx.sh(0) else { return Ok(None) };
    let sp = a.kernel_shape.len();
    for (i, &p) in a.pads.iter().enumerate() {
        if a.kernel_shape.get(i % sp.max(1)).is_some_and(|&k| p >= k) {
            return Err(format!("pads {:?} must each be less than the kernel {:?}", a.pads, a.kernel_shape));
        }
    }
    // The window's dims first: they check the input's rank.
    let spatial = spatial(x, &a.window())?;
    Ok(Some(Shape([&x.0[..2], &spatial[..]].concat())))
}
