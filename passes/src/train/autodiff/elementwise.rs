//! The gradient rules of the element-wise ops ([`super::rule`] dispatches by family).

use super::*;

/// The element-wise math functions ([`Kind::Unary`]); the activations are [`activation`]'s.
pub(super) fn unary(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { y, dy, dt, .. } = *at;
    let x = |i: usize| at.x(i);
    Ok(match op {
        // d√x = dx / (2√x).
        Op::Sqrt => {
            let half = b.scalar(0.5, dt);
            let t = b.op("mul", Op::Mul, &[dy, half]);
            vec![Some(b.op("div", Op::Div, &[t, y]))]
        }
        // d eˣ = eˣ dx.
        Op::Exp => vec![Some(b.op("mul", Op::Mul, &[dy, y]))],
        // d ln x = dx / x.
        Op::Log => vec![Some(b.op("div", Op::Div, &[dy, x(0)?]))],
        // d(−x) = −dx.
        Op::Neg => vec![Some(b.op("neg", Op::Neg, &[dy]))],
        // d(1/x) = −dx / x² = −y² dx.
        Op::Reciprocal => {
            let t = b.op("mul", Op::Mul, &[y, y]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("neg", Op::Neg, &[t]))]
        }
        // d|x| = sign(x) dx.
        Op::Abs => {
            let s = b.op("sign", Op::Sign, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, s]))]
        }
        op if op.trig().is_some() => vec![Some(rules::trig(b, op.trig().unwrap(), x(0)?, y, dy)?)],
        // d sin x = cos x dx.
        Op::Sin => {
            let c = b.op("cos", Op::Cos, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, c]))]
        }
        // d cos x = −sin x dx.
        Op::Cos => {
            let s = b.op("sin", Op::Sin, &[x(0)?]);
            let t = b.op("mul", Op::Mul, &[dy, s]);
            vec![Some(b.op("neg", Op::Neg, &[t]))]
        }
        // d σ(x) = σ(x)(1 − σ(x)) dx.
        Op::Sigmoid => {
            let one = b.scalar(1.0, dt);
            let t = b.op("sub", Op::Sub, &[one, y]);
            let t = b.op("mul", Op::Mul, &[y, t]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        // d tanh(x) = (1 − tanh²(x)) dx.
        Op::Tanh => {
            let one = b.scalar(1.0, dt);
            let t = b.op("mul", Op::Mul, &[y, y]);
            let t = b.op("sub", Op::Sub, &[one, t]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        // d erf(x) = 2/√π · e^(−x²) dx.
        Op::Erf => {
            let x0 = x(0)?;
            let k = b.scalar(2.0 / std::f64::consts::PI.sqrt(), dt);
            let t = b.op("mul", Op::Mul, &[x0, x0]);
            let t = b.op("neg", Op::Neg, &[t]);
            let t = b.op("exp", Op::Exp, &[t]);
            let t = b.op("mul", Op::Mul, &[t, k]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        _ => return activation(b, at),
    })
}

/// The activations ([`Kind::Unary`]).
pub(super) fn activation(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { y, dy, dt, .. } = *at;
    let x = |i: usize| at.x(i);
    Ok(match op {
        // d relu(x) = [y > 0] dx, in ai.mpc::ReluGrad.
        Op::Relu => vec![Some(b.op("relu", Op::ReluGrad, &[dy, y]))],
        // d leaky(x) = (x > 0 ? 1 : α) dx.
        Op::LeakyRelu(a) => {
            let (zero, alpha) = (b.scalar(0.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let s = b.op("mul", Op::Mul, &[dy, alpha]);
            vec![Some(b.op("where", Op::Where, &[m, dy, s]))]
        }
        // d elu(x) = (x > 0 ? 1 : α·eˣ = y + α) dx.
        Op::Elu(a) => {
            let (zero, alpha) = (b.scalar(0.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let t = b.op("add", Op::Add, &[y, alpha]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, dy, t]))]
        }
        // d celu(x) = (x > 0 ? 1 : e^(x/α) = y/α + 1) dx.
        Op::Celu(a) => {
            let (zero, one, alpha) = (b.scalar(0.0, dt), b.scalar(1.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let t = b.op("div", Op::Div, &[y, alpha]);
            let t = b.op("add", Op::Add, &[t, one]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, dy, t]))]
        }
        // d selu(x) = (x > 0 ? γ : γ·α·eˣ = y + γ·α) dx.
        Op::Selu(a) => {
            let zero = b.scalar(0.0, dt);
            let (g, ga) = (b.scalar(a.gamma as f64, dt), b.scalar(a.gamma as f64 * a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let pos = b.op("mul", Op::Mul, &[dy, g]);
            let t = b.op("add", Op::Add, &[y, ga]);
            let neg = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, pos, neg]))]
        }
        // d hardsigmoid(x) = (0 < y < 1 ? α : 0) dx.
        Op::HardSigmoid(a) => {
            let (zero, one, alpha) = (b.scalar(0.0, dt), b.scalar(1.0, dt), b.scalar(a.alpha as f64, dt));
            let lo = b.op("above", Op::Greater, &[y, zero]);
            let hi = b.op("below", Op::Less, &[y, one]);
            let m = b.op("mask", Op::And, &[lo, hi]);
            let t = b.op("mul", Op::Mul, &[dy, alpha]);
            vec![Some(b.op("where", Op::Where, &[m, t, zero]))]
        }
        // d hardswish(x) = (x < −3 ? 0 : x > 3 ? 1 : (2x + 3)/6) dx (PyTorch's choice at the kinks).
        Op::HardSwish => {
            let x0 = x(0)?;
            let (zero, third, half) = (b.scalar(0.0, dt), b.scalar(1.0 / 3.0, dt), b.scalar(0.5, dt));
            let (m3, p3) = (b.scalar(-3.0, dt), b.scalar(3.0, dt));
            let lo = b.op("below", Op::Less, &[x0, m3]);
            let hi = b.op("above", Op::Greater, &[x0, p3]);
            let t = b.op("mul", Op::Mul, &[x0, third]);
            let t = b.op("add", Op::Add, &[t, half]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            let t = b.op("where", Op::Where, &[hi, dy, t]);
            vec![Some(b.op("where", Op::Where, &[lo, zero, t]))]
        }
        // d softplus(x) = σ(x) dx.
        Op::Softplus => {
            let s = b.op("sigmoid", Op::Sigmoid, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, s]))]
        }
        // d mish(x) = (tanh(sp) + x·σ(x)·(1 − tanh²(sp))) dx with sp = softplus(x).
        Op::Mish => {
            let (x0, one) = (x(0)?, b.scalar(1.0, dt));
            let sp = b.op("softplus", Op::Softplus, &[x0]);
            let t = b.op("tanh", Op::Tanh, &[sp]);
            let t2 = b.op("square", Op::Mul, &[t, t]);
            let sech2 = b.op("sub", Op::Sub, &[one, t2]);
            let s = b.op("sigmoid", Op::Sigmoid, &[x0]);
            let u = b.op("mul", Op::Mul, &[x0, s]);
            let u = b.op("mul", Op::Mul, &[u, sech2]);
            let d = b.op("add", Op::Add, &[t, u]);
            vec![Some(b.op("mul", Op::Mul, &[dy, d]))]
        }
        // d softsign(x) = dx / (1 + |x|)².
        Op::Softsign => {
            let one = b.scalar(1.0, dt);
            let t = b.op("abs", Op::Abs, &[x(0)?]);
            let t = b.op("add", Op::Add, &[t, one]);
            let t = b.op("mul", Op::Mul, &[t, t]);
            vec![Some(b.op("div", Op::Div, &[dy, t]))]
        }
        // d gelu(x) = (Φ(x) + x·φ(x)) dx (tanh form: its own derivative), in ai.mpc::GeluGrad.
        Op::Gelu(a) => vec![Some(b.op("gelu", Op::GeluGrad(Box::new(a.clone())), &[dy, x(0)?]))],
        other => return Err(no_rule(other)),
    })
}

/// The arithmetic of two broadcast operands ([`Kind::Arith`]).
pub(super) fn arith(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { y, dy, dt, .. } = *at;
    let x = |i: usize| at.x(i);
    let want = |i: usize| at.want(i);
    Ok(match op {
        // d(a+b) = da + db, summed over broadcast axes.
        Op::Add | Op::Sub => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) { Some(b.unbroadcast(dy, a, y)?) } else { None };
            let db = if want(1) {
                let d = if matches!(op, Op::Sub) { b.op("neg", Op::Neg, &[dy]) } else { dy };
                Some(b.unbroadcast(d, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d(a mod b) = da − q·db, q = (a − y)/b the whole quotient (floored, or truncated for fmod).
        Op::Mod(_) => {
            let (a0, c) = (x(0)?, x(1)?);
            let da = if want(0) { Some(b.unbroadcast(dy, a0, y)?) } else { None };
            let dc = if want(1) {
                let q = b.op("sub", Op::Sub, &[a0, y]);
                let q = b.op("div", Op::Div, &[q, c]);
                let q = b.op("round", Op::Round, &[q]);
                let t = b.op("mul", Op::Mul, &[dy, q]);
                let t = b.op("neg", Op::Neg, &[t]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, dc]
        }
        // d(a·b) = b·da + a·db.
        Op::Mul => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) {
                let t = b.op("mul", Op::Mul, &[dy, c]);
                Some(b.unbroadcast(t, a, y)?)
            } else {
                None
            };
            let db = if want(1) {
                let t = b.op("mul", Op::Mul, &[dy, a]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d(a/b) = da/b − (a/b)·db/b.
        Op::Div => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) {
                let t = b.op("div", Op::Div, &[dy, c]);
                Some(b.unbroadcast(t, a, y)?)
            } else {
                None
            };
            let db = if want(1) {
                let q = b.op("div", Op::Div, &[y, c]);
                let t = b.op("mul", Op::Mul, &[dy, q]);
                let t = b.op("neg", Op::Neg, &[t]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d(a^p) = p·a^(p−1)·da + a^p·ln(a)·dp.
        Op::Pow => pow(b, at)?,
        // d prelu(x, s) = (x < 0 ? s : 1) dx + (x < 0 ? x : 0) ds, summed over broadcast axes.
        Op::PRelu => {
            let (x0, s) = (x(0)?, x(1)?);
            let zero = b.scalar(0.0, dt);
            let m = b.op("mask", Op::Less, &[x0, zero]);
            let dx = if want(0) {
                let t = b.op("mul", Op::Mul, &[dy, s]);
                let t = b.op("where", Op::Where, &[m, t, dy]);
                Some(b.unbroadcast(t, x0, y)?)
            } else {
                None
            };
            let ds = if want(1) {
                let t = b.op("mul", Op::Mul, &[dy, x0]);
                let t = b.op("where", Op::Where, &[m, t, zero]);
                Some(b.unbroadcast(t, s, y)?)
            } else {
                None
            };
            vec![dx, ds]
        }
        other => return Err(no_rule(other)),
    })
}

/// Sum, Mean, Max, Min, Clip, Where and Cast ([`Kind::Variadic`], [`Kind::Select`], [`Kind::Cast`]).
pub(super) fn select(b: &mut Builder, at: &At) -> Rule {
    let op = &at.node.op;
    let At { node, y, dy, dt, wants, .. } = *at;
    let x = |i: usize| at.x(i);
    let want = |i: usize| at.want(i);
    Ok(match op {
        // d/dx cast(x) = cast back to x's dtype.
        Op::Cast(_) => {
            let to = b.dtype(x(0)?)?;
            if let Some(d) = narrow_loss_grad(b, x(0)?, y, dy) {
                return Ok(vec![Some(d)]);
            }
            vec![Some(b.op("cast", Op::Cast(CastAttrs { to, ..Default::default() }), &[dy]))]
        }
        // d Σxᵢ = dy for every input (÷ n for the mean), summed over its broadcast axes.
        Op::Sum | Op::Mean => {
            let n = node.inputs().len();
            let d = if matches!(op, Op::Mean) && n > 1 {
                let k = b.scalar(n as f64, dt);
                b.op("div", Op::Div, &[dy, k])
            } else {
                dy
            };
            let mut grads = Vec::with_capacity(n);
            for i in 0..n {
                grads.push(if want(i) { Some(b.unbroadcast(d, x(i)?, y)?) } else { None });
            }
            grads
        }
        // d max(x₁, …, xₙ): dy goes to the inputs equal to the result, split equally between tied
        // ones (torch.maximum's convention), summed over broadcast axes; likewise for min.
        Op::Max | Op::Min => rules::extremum(b, node, dy, wants)?,
        // d clip(x, lo, hi) = (lo ≤ x ≤ hi ? 1 : 0) dx (PyTorch's clamp: the bounds pass the gradient).
        Op::Clip => {
            let x0 = x(0)?;
            let lo = node.input(1).map(|v| b.op("above", Op::GreaterOrEqual, &[x0, v]));
            let hi = node.input(2).map(|v| b.op("below", Op::LessOrEqual, &[x0, v]));
            let m = match (lo, hi) {
                (Some(l), Some(h)) => b.op("mask", Op::And, &[l, h]),
                (Some(m), None) | (None, Some(m)) => m,
                (None, None) => return Ok(vec![Some(dy)]),
            };
            let zero = b.scalar(0.0, dt);
            vec![Some(b.op("where", Op::Where, &[m, dy, zero]))]
        }
        // d where(c, a, b) = (c ? dy : 0, c ? 0 : dy).
        Op::Where => {
            let c = x(0)?;
            let zero = b.scalar(0.0, dt);
            let da = if want(1) {
                let t = b.op("where", Op::Where, &[c, dy, zero]);
                Some(b.unbroadcast(t, x(1)?, y)?)
            } else {
                None
            };
            let db = if want(2) {
                let t = b.op("where", Op::Where, &[c, zero, dy]);
                Some(b.unbroadcast(t, x(2)?, y)?)
            } else {
                None
            };
            vec![None, da, db]
        }
        other => return Err(no_rule(other)),
    })
}

/// d(a^p) = p·a^(p−1)·da + a^p·ln(a)·dp.
fn pow(b: &mut Builder, at: &At) -> Rule {
    let At { y, dy, .. } = *at;
    let (x, want) = (|i: usize| at.x(i), |i: usize| at.want(i));
    let (a, p) = (x(0)?, x(1)?);
    let da = if want(0) {
        let one = b.scalar(1.0, b.dtype(p)?);
        let pm1 = b.op("sub", Op::Sub, &[p, one]);
        let t = b.op("pow", Op::Pow, &[a, pm1]);
        let t = b.op("mul", Op::Mul, &[t, p]);
        let t = b.op("mul", Op::Mul, &[dy, t]);
        Some(b.unbroadcast(t, a, y)?)
    } else {
        None
    };
    let dp = if want(1) {
        let l = b.op("log", Op::Log, &[a]);
        let t = b.op("mul", Op::Mul, &[y, l]);
        let t = b.op("mul", Op::Mul, &[dy, t]);
        Some(b.unbroadcast(t, p, y)?)
    } else {
        None
    };
    Ok(vec![da, dp])
}
