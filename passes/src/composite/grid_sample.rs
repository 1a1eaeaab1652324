//! GridSample (opsets 16, 20 and 22) as the ops it is made of, sampling as onnxruntime does.
//!
//! Along spatial axis k of x (size L, grid component r-1-k), the grid's value g becomes the
//! coordinate u = (g + 1)/2 · (L - 1) with `align_corners`, else ((g + 1)·L - 1)/2, whose taps are
//! `Round(u)` (nearest, halves to even), `floor(u)` and `floor(u) + 1` weighted `floor(u) + 1 - u`
//! and `u - floor(u)` (linear), or `floor(u) - 1 .. floor(u) + 2` weighted by Keys' cubic with a =
//! -0.75 at `u - floor(u)` (cubic, 2-D only). The padding applies to each tap's index, as
//! onnxruntime's does: `zeros` weighs an index outside the axis 0, `border` clamps it, `reflection`
//! mirrors it about the borders (-0.5 and L - 0.5, or 0 and L - 1 with `align_corners`) until it
//! is inside. Every combination of one tap per axis is a GatherElements of x flattened to
//! [N, C, S] at the taps' flat index, times the product of their weights; the sum is shaped
//! [N, C, grid's spatial dims]. Gradients: x's through the gathers, the grid's through the weights
//! (the taps' indices are piecewise constant in it, as in torch).

use mpc_ir::attr::{take, Attrs};
use mpc_ir::ops::{AxisAttrs, CastAttrs, ModAttrs, ShapeAttrs};
use mpc_ir::{DType, Op, Tensor, ValueId};

use super::{int, At};

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

/// One tap along one axis: its index (int64), its weight (none: 1) and, with zero padding,
/// whether the index is inside the axis.
struct Tap {
    index: ValueId,
    weight: Option<ValueId>,
    inside: Option<ValueId>,
}

impl At<'_> {
    pub(super) fn grid_sample(&mut self, a: &mut Attrs) -> Option<()> {
        let r = self.rank.checked_sub(2).filter(|&r| r >= 1)?;
        let grid = self.g.node(self.n).input(1)?;
        let grid_shape = self.g.ty(grid).shape.as_ref()?;
        let last = grid_shape.dims().last().and_then(|d| d.fixed());
        if grid_shape.rank() != r + 2 || last.is_some_and(|l| l != r as u64) {
            return None;
        }
        if !self.dtype.is_float() || self.g.ty(grid).dtype != Some(self.dtype) {
            return None;
        }
        // An empty spatial axis has nothing to sample.
        if self.g.ty(self.x).shape.as_ref()?.dims()[2..].iter().any(|d| d.fixed() == Some(0)) {
            return None;
        }
        let mode = match take::<String>(a, "mode").ok()?.as_deref() {
            None | Some("bilinear" | "linear") => Mode::Linear,
            Some("nearest") => Mode::Nearest,
            Some("bicubic" | "cubic") if r == 2 => Mode::Cubic,
            _ => return None,
        };
        let padding = match take::<String>(a, "padding_mode").ok()?.as_deref() {
            None | Some("zeros") => Padding::Zeros,
            Some("border") => Padding::Border,
            Some("reflection") => Padding::Reflection,
            _ => return None,
        };
        let align = int(a, "align_corners", 0)? == 1;
        let x = self.x;
        // [N, C, S] and [N, P, r], the sizes computed (not -1: N or C may be 0).
        let flat = self.merged("flat", x, 2, None);
        let points = self.merged("points", grid, 1, Some(r as i64));
        // The coordinates, the taps and their weights in FP32 for an FP16 or BF16 grid (torch's
        // opmath; those dtypes misplace taps on long axes), the weights cast back for the sum.
        let dtype = self.dtype;
        let wide = matches!(dtype, DType::F16 | DType::BF16);
        let points = if wide {
            self.dtype = DType::F32;
            self.op("points_f32", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[points])
        } else {
            points
        };
        let mut axes: Vec<(Vec<Tap>, ValueId)> = Vec::with_capacity(r);
        for k in 0..r {
            let len = self.dim(&format!("len{k}"), x, 2 + k);
            let component = self.konst(&format!("component{k}"), Tensor::scalar_i64((r - 1 - k) as i64));
            let g = self.op(&format!("g{k}"), Op::Gather(AxisAttrs { axis: 2 }), &[points, component]);
            let mut taps = self.axis_taps(k, g, len, mode, padding, align);
            if wide {
                for (j, t) in taps.iter_mut().enumerate() {
                    let back = Op::Cast(CastAttrs { saturate: true, to: dtype });
                    t.weight = t.weight.map(|w| self.op(&format!("weight{k}_{j}_low"), back, &[w]));
                }
            }
            axes.push((taps, len));
        }
        self.dtype = dtype;
        let sum = self.combine(flat, &axes)?;
        let head = self.op("batch_channels", Op::Shape(ShapeAttrs { start: 0, end: Some(2) }), &[x]);
        let tail = self.op("grid_dims", Op::Shape(ShapeAttrs { start: 1, end: Some(r as i64 + 1) }), &[grid]);
        let out = self.op("out_shape", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &[head, tail]);
        self.finish(Op::Reshape(Default::default()), &[sum, out])
    }

    /// The taps of axis `k` for the grid's component `g` ([N, P]) on an axis of `len` (int64).
    fn axis_taps(&mut self, k: usize, g: ValueId, len: ValueId, mode: Mode, padding: Padding, align: bool) -> Vec<Tap> {
        let w = |s: &str| format!("{s}{k}");
        let cast = Op::Cast(CastAttrs { saturate: true, to: self.dtype });
        let l = self.op(&w("len_f"), cast, &[len]);
        let one = self.scalar("one", 1.0);
        let two = self.scalar("two", 2.0);
        let last = self.op(&w("last"), Op::Sub, &[l, one]);
        let g1 = self.op(&w("g_plus_1"), Op::Add, &[g, one]);
        let u = if align {
            let half = self.op(&w("half"), Op::Div, &[g1, two]);
            self.op(&w("u"), Op::Mul, &[half, last])
        } else {
            let scaled = self.op(&w("scaled"), Op::Mul, &[g1, l]);
            let less = self.op(&w("less_1"), Op::Sub, &[scaled, one]);
            self.op(&w("u"), Op::Div, &[less, two])
        };
        let taps: Vec<(ValueId, Option<ValueId>)> = match mode {
            Mode::Nearest => vec![(self.op(&w("nearest"), Op::Round, &[u]), None)],
            Mode::Linear => {
                let lo = self.op(&w("floor"), Op::Floor, &[u]);
                let hi = self.op(&w("ceil"), Op::Add, &[lo, one]);
                let w_lo = self.op(&w("w_lo"), Op::Sub, &[hi, u]);
                let w_hi = self.op(&w("w_hi"), Op::Sub, &[u, lo]);
                vec![(lo, Some(w_lo)), (hi, Some(w_hi))]
            }
            Mode::Cubic => {
                let f = self.op(&w("floor"), Op::Floor, &[u]);
                let t = self.op(&w("t"), Op::Sub, &[u, f]);
                let coeffs = self.cubic_coeffs(k, t);
                (0..4)
                    .map(|j| {
                        let off = self.scalar(&format!("offset{j}"), j as f64 - 1.0);
                        (self.op(&format!("tap{k}_{j}"), Op::Add, &[f, off]), Some(coeffs[j]))
                    })
                    .collect()
            }
        };
        taps.into_iter()
            .enumerate()
            .map(|(j, (i, weight))| self.padded(&format!("{k}_{j}"), i, (l, last), padding, align, weight))
            .collect()
    }

    /// Keys' cubic weights of the four taps at fraction `t` (onnxruntime's formulas, a = -0.75).
    fn cubic_coeffs(&mut self, k: usize, t: ValueId) -> [ValueId; 4] {
        let c = |at: &mut Self, what: &str, v: f64| at.scalar(what, v);
        let a = c(self, "a", -0.75);
        let (one, two) = (c(self, "one", 1.0), c(self, "two", 2.0));
        let name = |s: &str, j: usize| format!("cubic{k}_{j}_{s}");
        // The outer taps: ((a·s - 5a)·s + 8a)·s - 4a at s = t + 1 and s = 2 - t.
        let outer = |at: &mut Self, j: usize, s: ValueId| {
            let (a5, a8, a4) = (c(at, "a5", -3.75), c(at, "a8", -6.0), c(at, "a4", -3.0));
            let v = at.op(&name("as", j), Op::Mul, &[a, s]);
            let v = at.op(&name("m5a", j), Op::Sub, &[v, a5]);
            let v = at.op(&name("s1", j), Op::Mul, &[v, s]);
            let v = at.op(&name("p8a", j), Op::Add, &[v, a8]);
            let v = at.op(&name("s2", j), Op::Mul, &[v, s]);
            at.op(&name("m4a", j), Op::Sub, &[v, a4])
        };
        // The inner taps: ((a + 2)·s - (a + 3))·s·s + 1 at s = t and s = 1 - t.
        let inner = |at: &mut Self, j: usize, s: ValueId| {
            let (a2, a3) = (c(at, "a_plus_2", 1.25), c(at, "a_plus_3", 2.25));
            let v = at.op(&name("a2s", j), Op::Mul, &[a2, s]);
            let v = at.op(&name("ma3", j), Op::Sub, &[v, a3]);
            let v = at.op(&name("s1", j), Op::Mul, &[v, s]);
            let v = at.op(&name("s2", j), Op::Mul, &[v, s]);
            at.op(&name("p1", j), Op::Add, &[v, one])
        };
        let t1 = self.op(&name("s", 0), Op::Add, &[t, one]);
        let one_t = self.op(&name("s", 2), Op::Sub, &[one, t]);
        let two_t = self.op(&name("s", 3), Op::Sub, &[two, t]);
        [outer(self, 0, t1), inner(self, 1, t), inner(self, 2, one_t), outer(self, 3, two_t)]
    }

    /// Tap index `i` (integral, of x's dtype) padded on an axis of `l` elements (`last` = l - 1),
    /// as int64.
    fn padded(
        &mut self,
        k: &str,
        i: ValueId,
        (l, last): (ValueId, ValueId),
        padding: Padding,
        align: bool,
        weight: Option<ValueId>,
    ) -> Tap {
        let w = |s: &str| format!("pad{k}_{s}");
        let zero = self.scalar("zero", 0.0);
        let (i, inside) = match padding {
            Padding::Zeros => {
                let ge = self.op(&w("from_first"), Op::GreaterOrEqual, &[i, zero]);
                let le = self.op(&w("to_last"), Op::LessOrEqual, &[i, last]);
                (i, Some(self.op(&w("inside"), Op::And, &[ge, le])))
            }
            Padding::Border => (i, None),
            Padding::Reflection => (self.reflect(k, i, l, last, align), None),
        };
        // Clamped into the axis (NaN to 0), so that every gather reads inside x.
        let nan = self.op(&w("is_nan"), Op::IsNaN, &[i]);
        let i = self.op(&w("not_nan"), Op::Where, &[nan, zero, i]);
        let i = self.op(&w("above_0"), Op::Max, &[i, zero]);
        let i = self.op(&w("clamped"), Op::Min, &[i, last]);
        let index = self.op(&w("index"), Op::Cast(CastAttrs { saturate: true, to: DType::I64 }), &[i]);
        Tap { index, weight, inside }
    }

    /// onnxruntime's reflection of `i` about [lo, hi] = [-0.5, l - 0.5] (or [0, l - 1] with
    /// `align`): the distance d past the border it crossed, n = floor(d / (hi - lo)) reflections,
    /// then lo + rest or hi - rest by n's parity.
    fn reflect(&mut self, k: &str, i: ValueId, l: ValueId, last: ValueId, align: bool) -> ValueId {
        let w = |s: &str| format!("reflect{k}_{s}");
        let (lo, hi) = if align {
            (self.scalar("zero", 0.0), last)
        } else {
            let half = self.scalar("half", 0.5);
            let minus = self.scalar("minus_half", -0.5);
            (minus, self.op(&w("hi"), Op::Sub, &[l, half]))
        };
        let range = self.op(&w("range"), Op::Sub, &[hi, lo]);
        let below = self.op(&w("below"), Op::Less, &[i, lo]);
        let above = self.op(&w("above"), Op::Greater, &[i, hi]);
        let d_lo = self.op(&w("d_lo"), Op::Sub, &[lo, i]);
        let d_hi = self.op(&w("d_hi"), Op::Sub, &[i, hi]);
        let d = self.op(&w("d"), Op::Where, &[below, d_lo, d_hi]);
        let q = self.op(&w("q"), Op::Div, &[d, range]);
        let n = self.op(&w("n"), Op::Floor, &[q]);
        let span = self.op(&w("span"), Op::Mul, &[n, range]);
        let rest = self.op(&w("rest"), Op::Sub, &[d, span]);
        let two = self.scalar("two", 2.0);
        let parity = self.op(&w("parity"), Op::Mod(ModAttrs { fmod: true }), &[n, two]);
        let zero = self.scalar("zero", 0.0);
        let even = self.op(&w("even"), Op::Equal, &[parity, zero]);
        let from_lo = self.op(&w("from_lo"), Op::Add, &[lo, rest]);
        let from_hi = self.op(&w("from_hi"), Op::Sub, &[hi, rest]);
        let past_lo = self.op(&w("past_lo"), Op::Where, &[even, from_lo, from_hi]);
        let past_hi = self.op(&w("past_hi"), Op::Where, &[even, from_hi, from_lo]);
        let inner = self.op(&w("inner"), Op::Where, &[above, past_hi, i]);
        self.op(&w("reflected"), Op::Where, &[below, past_lo, inner])
    }

    /// The sum over every combination of one tap per axis of x's flattened gather at the taps'
    /// flat index (0 outside the axis with zero padding) times their weights: [N, C, P].
    fn combine(&mut self, flat: ValueId, axes: &[(Vec<Tap>, ValueId)]) -> Option<ValueId> {
        let r = axes.len();
        // Each axis's stride in the flattened spatial dims: the product of the later sizes.
        let mut strides: Vec<Option<ValueId>> = vec![None; r];
        for k in (0..r.saturating_sub(1)).rev() {
            let later = axes[k + 1].1;
            strides[k] = Some(match strides[k + 1] {
                Some(s) => self.op(&format!("stride{k}"), Op::Mul, &[s, later]),
                None => later,
            });
        }
        let counts: Vec<usize> = axes.iter().map(|(t, _)| t.len()).collect();
        let total: usize = counts.iter().product();
        let one_axis = self.ints("channel_axis", &[1]);
        // Every term's index is [N, 1, P], expanded over the channels: one target for all.
        let mut target = None;
        let mut sum = None;
        for c in 0..total {
            let (mut rem, mut pick) = (c, vec![0; r]);
            for k in (0..r).rev() {
                pick[k] = rem % counts[k];
                rem /= counts[k];
            }
            let tag = pick.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("_");
            let (mut index, mut weight, mut inside): (Option<ValueId>, Option<ValueId>, Option<ValueId>) =
                (None, None, None);
            for k in 0..r {
                let tap = &axes[k].0[pick[k]];
                let (ti, tw, tin) = (tap.index, tap.weight, tap.inside);
                let part = match strides[k] {
                    Some(s) => self.op(&format!("offset{tag}_{k}"), Op::Mul, &[ti, s]),
                    None => ti,
                };
                index = Some(match index {
                    Some(v) => self.op(&format!("index{tag}_{k}"), Op::Add, &[v, part]),
                    None => part,
                });
                weight = match (weight, tw) {
                    (Some(v), Some(t)) => Some(self.op(&format!("weight{tag}_{k}"), Op::Mul, &[v, t])),
                    (v, t) => v.or(t),
                };
                inside = match (inside, tin) {
                    (Some(v), Some(t)) => Some(self.op(&format!("inside{tag}_{k}"), Op::And, &[v, t])),
                    (v, t) => v.or(t),
                };
            }
            let index = self.op(&format!("index{tag}"), Op::Unsqueeze, &[index?, one_axis]);
            let target = match target {
                Some(t) => t,
                None => *target.insert(self.gather_shape(flat, index)),
            };
            let index = self.op(&format!("index{tag}_all"), Op::Expand, &[index, target]);
            let mut term = self.op(&format!("sample{tag}"), Op::GatherElements(AxisAttrs { axis: 2 }), &[flat, index]);
            // Zero padding: a tap outside reads 0 (not the clamped element times 0, which is NaN
            // beside an Inf).
            if let Some(m) = inside {
                let m = self.op(&format!("inside{tag}"), Op::Unsqueeze, &[m, one_axis]);
                let zero = self.scalar("zero", 0.0);
                term = self.op(&format!("padded{tag}"), Op::Where, &[m, term, zero]);
            }
            if let Some(w) = weight {
                let w = self.op(&format!("weight{tag}"), Op::Unsqueeze, &[w, one_axis]);
                term = self.op(&format!("weighted{tag}"), Op::Mul, &[term, w]);
            }
            sum = Some(match sum {
                Some(s) => self.op(&format!("sum{tag}"), Op::Add, &[s, term]),
                None => term,
            });
        }
        sum
    }

    /// `v` with its dims from `from` on (to the last, or to the one before it when `last` is
    /// given) merged into one, and `last` after them: the sizes computed (a product of its dims,
    /// which inference follows), so that an empty dim is no -1 to infer.
    fn merged(&mut self, what: &str, v: ValueId, from: usize, last: Option<i64>) -> ValueId {
        let rank = self.g.ty(v).shape.as_ref().map_or(0, |s| s.rank());
        let head = self.op(&format!("{what}_head"), Op::Shape(ShapeAttrs { start: 0, end: Some(from as i64) }), &[v]);
        let mut size = self.konst(&format!("{what}_one"), Tensor::scalar_i64(1));
        for d in from..rank - usize::from(last.is_some()) {
            let dim = self.dim(&format!("{what}_dim{d}"), v, d);
            size = self.op(&format!("{what}_size{d}"), Op::Mul, &[size, dim]);
        }
        let one = self.ints(&format!("{what}_one_dim"), &[1]);
        let size = self.op(&format!("{what}_size"), Op::Reshape(Default::default()), &[size, one]);
        let mut parts = vec![head, size];
        if let Some(l) = last {
            parts.push(self.ints(&format!("{what}_last"), &[l]));
        }
        let shape = self.op(&format!("{what}_shape"), Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &parts);
        let exact = Op::Reshape(mpc_ir::ops::ReshapeAttrs { allowzero: true });
        self.op(what, exact, &[v, shape])
    }

    /// [N, C, P]: the flattened input's batch and channels, the index's points.
    fn gather_shape(&mut self, flat: ValueId, index: ValueId) -> ValueId {
        let head = self.op("flat_head", Op::Shape(ShapeAttrs { start: 0, end: Some(2) }), &[flat]);
        let tail = self.op("index_points", Op::Shape(ShapeAttrs { start: 2, end: None }), &[index]);
        self.op("gather_shape", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &[head, tail])
    }
}
