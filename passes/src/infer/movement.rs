//! Type rules of the data-movement ops: reshapes, squeezes, concatenation, splitting, slicing,
//! padding, resizing, einsum.

use mpc_ir::{normalize_axis, Dim, Op, Shape, SymExpr};

use super::known::Elem;
use super::rules::{check_eq, t, NodeCx, R};

/// Reshape, including `0` (copy) and `-1` (infer), with symbolic dims cancelled where the same
/// symbol appears in the input and the target.
pub(super) fn reshape(cx: &NodeCx, allowzero: bool) -> Result<Option<Shape>, String> {
    let Some(target) = cx.known(1) else {
        return Ok(super::rules::vector_len(cx, 1).map(|r| Shape(vec![Dim::Unknown; r])));
    };
    let x = cx.sh(0);
    let mut out: Vec<Dim> = Vec::with_capacity(target.elems.len());
    let mut infer_at = None;
    for (i, e) in target.elems.iter().enumerate() {
        out.push(match e.int() {
            Some(0) if !allowzero => x.and_then(|x| x.0.get(i).cloned()).unwrap_or(Dim::Unknown),
            Some(-1) => {
                if infer_at.replace(i).is_some() {
                    return Err("more than one -1 in the target shape".into());
                }
                Dim::Unknown
            }
            Some(n) if n < -1 => return Err(format!("invalid target dimension {n}")),
            _ => e.dim(),
        });
    }
    let Some(x) = x else {
        return Ok(Some(Shape(out)));
    };
    // Element counts as expressions in the named sizes, without the -1 slot: the -1 is their
    // exact quotient. Counts that cannot be equal for any non-zero sizes are an error.
    let count = |dims: &[Dim], skip: Option<usize>| -> Option<SymExpr> {
        let mut n = SymExpr::constant(1);
        for (i, d) in dims.iter().enumerate() {
            if Some(i) != skip {
                n = n.mul(&d.expr()?)?;
            }
        }
        Some(n)
    };
    if let (Some(xn), Some(tn)) = (count(&x.0, None), count(&out, infer_at)) {
        let ratio = xn.div_exact(&tn);
        let mismatch = match (infer_at, ratio) {
            (Some(i), Some(r)) => {
                out[i] = Dim::from_expr(r);
                false
            }
            // Constant counts that do not divide (or a zero count, which leaves -1 open).
            (Some(_), None) => xn.as_const().is_some() && tn.as_const().is_some(),
            (None, r) => match (xn.as_const(), tn.as_const()) {
                (Some(a), Some(b)) => a != b,
                // A constant ratio other than 1, either way ([4,batch,32] into [8,2*batch,16]).
                _ => [r, tn.div_exact(&xn)].iter().flatten().filter_map(SymExpr::as_const).any(|c| c != 1),
            },
        };
        if mismatch {
            let (target, x_count) =
                (show(&target.elems), if infer_at.is_some() { String::new() } else { format!(" ({xn} elements)") });
            let t_count = if infer_at.is_some() { String::new() } else { format!(" ({tn} elements)") };
            return Err(format!("cannot reshape {x}{x_count} into {target}{t_count}"));
        }
    }
    Ok(Some(Shape(out)))
}

fn show(elems: &[super::Elem]) -> String {
    let s: Vec<String> = elems
        .iter()
        .map(|e| match e {
            super::Elem::Int(i) => i.to_string(),
            super::Elem::Sym(s) => s.to_string(),
            super::Elem::Unknown => "?".into(),
        })
        .collect();
    format!("[{}]", s.join(","))
}

pub(super) fn squeeze(cx: &NodeCx) -> Result<Option<Shape>, String> {
    let Some(x) = cx.sh(0) else { return Ok(None) };
    let axes = match (cx.has(1), cx.ints(1)) {
        (true, Some(a)) => a,
        (true, None) => return Ok(None),
        (false, _) => {
            if x.0.iter().any(|d| d.fixed().is_none()) {
                return Ok(None);
            }
            return Ok(Some(Shape(x.0.iter().filter(|d| d.fixed() != Some(1)).cloned().collect())));
        }
    };
    let axes: Vec<usize> = axes
        .iter()
        .map(|&a| normalize_axis(a, x.rank()).ok_or(format!("axis {a} out of range")))
        .collect::<Result<_, _>>()?;
    for &a in &axes {
        if let Some(n) = x.0[a].fixed().filter(|&n| n != 1) {
            return Err(format!("cannot squeeze axis {a} of size {n}"));
        }
    }
    Ok(Some(Shape(x.0.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| d.clone()).collect())))
}

pub(super) fn unsqueeze(cx: &NodeCx) -> Result<Option<Shape>, String> {
    let (Some(x), Some(axes)) = (cx.sh(0), cx.ints(1)) else {
        return Ok(None);
    };
    let r = x.rank() + axes.len();
    let mut axes: Vec<usize> =
        axes.iter().map(|&a| normalize_axis(a, r).ok_or(format!("axis {a} out of range"))).collect::<Result<_, _>>()?;
    axes.sort();
    if axes.windows(2).any(|w| w[0] == w[1]) {
        return Err(format!("axes {:?} repeat an axis", cx.ints(1).unwrap_or_default()));
    }
    let mut src = x.0.iter();
    Ok(Some(Shape(
        (0..r)
            .map(|i| if axes.contains(&i) { Dim::Fixed(1) } else { src.next().cloned().unwrap_or(Dim::Unknown) })
            .collect(),
    )))
}

pub(super) fn concat(cx: &NodeCx, axis: i64) -> Result<Option<Shape>, String> {
    let mut shapes = Vec::new();
    for i in 0..cx.n_inputs() {
        match cx.sh(i) {
            Some(s) => shapes.push(s),
            None => return Ok(None),
        }
    }
    let Some(first) = shapes.first() else {
        return Ok(None);
    };
    let a = super::axis_in(axis, first)?;
    let mut out = first.0.clone();
    let mut total = Some(0u64);
    for s in &shapes {
        if s.rank() != first.rank() {
            return Err(format!("inputs have different ranks: {first} and {s}"));
        }
        total = total.and_then(|t| Some(t + s.0[a].fixed()?));
        for (i, d) in s.0.iter().enumerate() {
            if i != a {
                check_eq(&out[i], d, "concatenated dims")?;
                if out[i].fixed().is_none() && d.fixed().is_some() {
                    out[i] = d.clone();
                }
            }
        }
    }
    out[a] = total.map_or(Dim::Unknown, Dim::Fixed);
    if shapes.len() == 1 {
        out[a] = first.0[a].clone();
    }
    Ok(Some(Shape(out)))
}

pub(super) fn split(cx: &NodeCx, axis: i64, num_outputs: Option<i64>) -> R {
    let n = cx.n_outputs();
    if let Some(k) = num_outputs.filter(|&k| k != n as i64) {
        return Err(format!("num_outputs is {k} but the node has {n} outputs"));
    }
    let d = cx.dt(0);
    let Some(x) = cx.sh(0) else {
        return Ok(vec![t(d, None); n]);
    };
    let a = normalize_axis(axis, x.rank()).ok_or(format!("axis {axis} out of range"))?;
    let sizes: Option<Vec<u64>> = if cx.has(1) {
        match cx.ints(1) {
            Some(v) if v.len() != n => return Err(format!("{} split sizes for {n} outputs", v.len())),
            Some(v) => Some(
                v.iter()
                    .map(|&s| {
                        u64::try_from(s).map_err(|_| format!("split sizes {v:?} has {s}; each must be 0 or more"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            None => None,
        }
    } else {
        x.0[a].fixed().map(|len| {
            let chunk = len.div_ceil(n.max(1) as u64);
            (0..n as u64).map(|i| chunk.min(len.saturating_sub(i * chunk))).collect()
        })
    };
    if let (Some(s), Some(len)) = (&sizes, x.0[a].fixed()) {
        if s.iter().try_fold(0u64, |acc, &x| acc.checked_add(x)) != Some(len) {
            return Err(format!("split sizes {s:?} do not add up to {len} over {n} outputs"));
        }
    }
    // Sizes the shapes compute (a concatenation's gradient split back by its inputs' symbolic
    // lengths): each part's dim is its element.
    let computed = cx.known(1).filter(|k| sizes.is_none() && k.elems.len() == n);
    Ok((0..n)
        .map(|i| {
            let mut s = x.clone();
            s.0[a] = match (&sizes, computed) {
                (Some(v), _) => Dim::Fixed(v[i]),
                (None, Some(k)) => k.elems[i].dim(),
                (None, None) => Dim::Unknown,
            };
            t(d, Some(s))
        })
        .collect())
}

pub(super) fn slice(cx: &NodeCx) -> Result<Option<Shape>, String> {
    let Some(x) = cx.sh(0) else { return Ok(None) };
    let (Some(starts), Some(ends)) = (cx.ints(1), cx.ints(2)) else {
        return Ok(Some(symbolic_slice(cx, x).unwrap_or_else(|| Shape(vec![Dim::Unknown; x.rank()]))));
    };
    // Axes or steps known only when the graph runs (graph inputs): the dims they may touch are
    // unknown until lowering binds them.
    let unknown = || Ok(Some(Shape(vec![Dim::Unknown; x.rank()])));
    let axes: Vec<i64> = match (cx.has(3), cx.ints(3)) {
        (false, _) => (0..starts.len() as i64).collect(),
        (true, Some(a)) => a,
        (true, None) => return unknown(),
    };
    let steps: Vec<i64> = match (cx.has(4), cx.ints(4)) {
        (false, _) => vec![1; starts.len()],
        (true, Some(s)) => s,
        (true, None) => return unknown(),
    };
    if axes.len() != starts.len() || ends.len() != starts.len() || steps.len() != starts.len() {
        return Err("starts, ends, axes and steps have different lengths".into());
    }
    let mut out = x.0.clone();
    for i in 0..starts.len() {
        let a = normalize_axis(axes[i], x.rank()).ok_or(format!("axis {} out of range", axes[i]))?;
        let step = steps[i];
        if step == 0 {
            return Err("slice step is 0".into());
        }
        out[a] = match x.0[a].fixed() {
            Some(len) => Dim::Fixed(mpc_ir::geometry::slice_dim(len as i64, starts[i], ends[i], step)?.1),
            None if starts[i] == 0 && ends[i] >= i32::MAX as i64 && step == 1 => x.0[a].clone(),
            None => Dim::Unknown,
        };
    }
    Ok(Some(Shape(out)))
}

/// A slice whose bounds are sizes the shapes compute: `x[:, :seq]` (a position buffer cut to the
/// sequence, as both torch exporters write `buffer[:, :input.size(1)]`) is `seq - start` long,
/// taking the bound to lie within the dim, as the model's own code does (lowering, where every
/// size is known, computes the exact length and checks it against the data).
fn symbolic_slice(cx: &NodeCx, x: &Shape) -> Option<Shape> {
    let (starts, ends) = (cx.known(1)?, cx.known(2)?);
    let n = starts.elems.len();
    let axes: Vec<i64> = if cx.has(3) { cx.ints(3)? } else { (0..n as i64).collect() };
    let steps: Vec<i64> = if cx.has(4) { cx.ints(4)? } else { vec![1; n] };
    if ends.elems.len() != n || axes.len() != n || steps.len() != n {
        return None;
    }
    let mut out = x.0.clone();
    for i in 0..n {
        let a = normalize_axis(axes[i], x.rank())?;
        out[a] = match (&starts.elems[i], &ends.elems[i], steps[i]) {
            (Elem::Int(s), Elem::Int(e), step) => match x.0[a].fixed() {
                Some(len) => Dim::Fixed(mpc_ir::geometry::slice_dim(len as i64, *s, *e, step).ok()?.1),
                None if *s == 0 && *e >= i32::MAX as i64 && step == 1 => x.0[a].clone(),
                None => Dim::Unknown,
            },
            (Elem::Int(s), Elem::Sym(e), 1) if *s >= 0 && e.is_nonnegative() => {
                Dim::from_expr(e.sub(&SymExpr::constant(*s))?)
            }
            _ => Dim::Unknown,
        };
    }
    Some(Shape(out))
}

pub(super) fn pad(cx: &NodeCx) -> Result<Option<Shape>, String> {
    super::one_value(cx, 2, "constant_value")?;
    let Some(x) = cx.sh(0) else { return Ok(None) };
    let Some(pads) = cx.ints(1) else {
        return Ok(Some(Shape(vec![Dim::Unknown; x.rank()])));
    };
    let axes: Vec<usize> = match cx.has(3) {
        true => match cx.ints(3) {
            Some(a) => a
                .iter()
                .map(|&a| normalize_axis(a, x.rank()).ok_or(format!("axis {a} out of range")))
                .collect::<Result<_, _>>()?,
            None => return Ok(Some(Shape(vec![Dim::Unknown; x.rank()]))),
        },
        false => (0..x.rank()).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(format!(
            "{} pads where {} axes need {} (a begin and an end each)",
            pads.len(),
            axes.len(),
            2 * axes.len()
        ));
    }
    let mode = match &cx.g.node(cx.n).op {
        Op::Pad(a) => a.mode,
        _ => mpc_ir::ops::PadMode::Constant,
    };
    let mut out = x.0.clone();
    for (i, &a) in axes.iter().enumerate() {
        out[a] = match x.0[a].fixed() {
            Some(n) => {
                let (b, e) = (pads[i], pads[i + axes.len()]);
                let limit = match mode {
                    mpc_ir::ops::PadMode::Constant => i64::MAX,
                    // Reflection mirrors inside the axis (again and again past its size, as numpy
                    // and the reference evaluator do; onnxruntime refuses more than the size less
                    // one), edge and wrap copy from it: an empty axis has nothing to copy.
                    _ if n == 0 => 0,
                    _ => i64::MAX,
                };
                if b.max(e) > limit {
                    return Err(format!("{mode:?} padding of {} on axis {a} of size {n}", b.max(e)));
                }
                match i64::try_from(n).ok().and_then(|n| n.checked_add(b)?.checked_add(e)) {
                    Some(m) if m >= 0 => Dim::Fixed(m as u64),
                    _ => return Err(format!("pads {b} and {e} on axis {a} of size {n} leave no valid size")),
                }
            }
            None if pads[i] == 0 && pads[i + axes.len()] == 0 => x.0[a].clone(),
            None => Dim::Unknown,
        };
    }
    Ok(Some(Shape(out)))
}

/// Resize: `sizes` or `scales` give the dims of the axes they name (all, or the `axes` attribute's).
pub(super) fn resize(cx: &NodeCx) -> Result<Option<Shape>, String> {
    let Some(x) = cx.sh(0) else { return Ok(None) };
    let axes: Vec<usize> = match &cx.g.node(cx.n).op {
        Op::Resize(a) if !a.axes.is_empty() => {
            a.axes.iter().map(|&d| super::axis_in(d, x)).collect::<Result<_, _>>()?
        }
        _ => (0..x.rank()).collect(),
    };
    let mut out = x.clone();
    let stretch = matches!(&cx.g.node(cx.n).op, Op::Resize(a) if a.keep_aspect_ratio_policy == mpc_ir::ops::AspectPolicy::Stretch);
    // Sizes computed from a symbolic shape (`Concat(Shape(x)[:2], [6])`): the dims they name.
    if let Some(k) = cx.known(3).filter(|k| stretch && !k.elems.is_empty() && k.ints().is_none()) {
        if k.elems.len() != axes.len() {
            return Err(format!("{} sizes for {} axes", k.elems.len(), axes.len()));
        }
        for (&ax, e) in axes.iter().zip(&k.elems) {
            out.0[ax] = e.dim();
        }
        return Ok(Some(out));
    }
    if let Some(sizes) = cx.has(3).then(|| cx.ints(3)).flatten().filter(|s| !s.is_empty()) {
        if sizes.len() != axes.len() {
            return Err(format!("{} sizes for {} axes", sizes.len(), axes.len()));
        }
        for (&ax, &s) in axes.iter().zip(&sizes) {
            out.0[ax] = Dim::Fixed(u64::try_from(s).map_err(|_| format!("sizes has {s}; each must be 0 or more"))?);
        }
        if let Op::Resize(a) = &cx.g.node(cx.n).op {
            if a.keep_aspect_ratio_policy != mpc_ir::ops::AspectPolicy::Stretch {
                // The sizes bound one scale for all the axes: the sizes that come out are known
                // only with the input's.
                let Some(dims) = x.as_fixed() else {
                    return Ok(Some(Shape(vec![Dim::Unknown; x.rank()])));
                };
                let dims: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
                let (o, _) = mpc_ir::geometry::resize_plan(a, &dims, None, Some(&sizes))?;
                return Ok(Some(Shape(o.iter().map(|&d| Dim::Fixed(d as u64)).collect())));
            }
        }
        return Ok(Some(out));
    }
    let scales = cx.g.node(cx.n).input(2).and_then(|v| crate::known::floats(cx.g, v));
    match scales {
        Some(sc) if sc.is_empty() && !cx.has(3) => Err("neither scales nor sizes is given".into()),
        Some(sc) if !sc.is_empty() && sc.len() != axes.len() => {
            Err(format!("{} scales for {} axes", sc.len(), axes.len()))
        }
        Some(sc) if sc.len() == axes.len() => {
            for (&ax, &s) in axes.iter().zip(&sc) {
                if !(s > 0.0 && s.is_finite()) {
                    return Err(format!("scales has {s}; each must be positive"));
                }
                out.0[ax] = match x.0[ax].fixed() {
                    Some(n) => Dim::Fixed(mpc_ir::geometry::scaled_dim(n, s).ok_or("a scaled dim overflows")?),
                    // floor(n * 1) is n: a symbolic batch at scale 1 stays itself.
                    None if s == 1.0 => x.0[ax].clone(),
                    None => Dim::Unknown,
                };
            }
            Ok(Some(out))
        }
        _ => Ok(Some(Shape(vec![Dim::Unknown; x.rank()]))),
    }
}

/// Einsum: output dims looked up by letter (an ellipsis written out as letters first).
pub(super) fn einsum(cx: &NodeCx, eq: &str) -> Result<Option<Shape>, String> {
    let mut eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    if eq.contains("...") {
        let Some(shapes) = einsum_shapes(cx) else { return Ok(None) };
        eq = mpc_ir::ops::einsum_expand(&eq, &shapes)?;
    }
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), r.to_string()),
        None => {
            let l = eq.clone();
            let mut letters: Vec<char> = l.chars().filter(|c| c.is_ascii_alphabetic()).collect();
            letters.sort();
            let once: String = letters.iter().filter(|c| letters.iter().filter(|d| d == c).count() == 1).collect();
            (l, once)
        }
    };
    if let Some(c) = rhs.chars().find(|&c| !lhs.contains(c)) {
        return Err(format!("`{eq}`: output label `{c}` is in no operand"));
    }
    if let Some(c) = rhs.chars().find(|&c| rhs.matches(c).count() > 1) {
        return Err(format!("`{eq}`: output label `{c}` appears twice"));
    }
    let mut dims: std::collections::HashMap<char, Dim> = Default::default();
    for (i, term) in lhs.split(',').enumerate() {
        let Some(s) = cx.sh(i) else { return Ok(None) };
        if s.rank() != term.len() {
            return Err(format!("`{eq}`: operand {i} has {} labels but rank {}", term.len(), s.rank()));
        }
        for (c, d) in term.chars().zip(&s.0) {
            let e = dims.entry(c).or_insert(d.clone());
            match (e.fixed(), d.fixed()) {
                (None, _) => *e = d.clone(),
                (Some(a), Some(b)) if a != b => {
                    return Err(format!("`{eq}`: label `{c}` is {a} in one operand and {b} in operand {i}"))
                }
                _ => {}
            }
        }
    }
    Ok(Some(Shape(rhs.chars().map(|c| dims.get(&c).cloned().unwrap_or(Dim::Unknown)).collect())))
}

/// The operands' dims as [`mpc_ir::ops::einsum_expand`] reads them, once every rank is known.
fn einsum_shapes(cx: &NodeCx) -> Option<Vec<Vec<Option<u64>>>> {
    (0..cx.n_inputs()).map(|i| cx.sh(i).map(|s| s.0.iter().map(|d| d.fixed()).collect())).collect()
}
