//! Geometry shared by type inference, lowering and every backend: convolution and pooling
//! windows (pads, strides, dilations, `ceil_mode`, `auto_pad`), ConvTranspose output sizes, Resize's
//! sampling, slice bounds, broadcasting and axes. One formula in one place: a shape that inference predicts is the
//! shape a kernel produces.

use serde::{Deserialize, Serialize};

use crate::ops::{AspectPolicy, CoordinateMode, NearestMode, ResizeAttrs, ResizeMode};
use crate::{Dim, Shape};

pub use crate::shape::normalize_axis;

/// The axes a Reduce* op reduces over an input of `rank`: its `axes` operand normalised to
/// `0..rank`, sorted and distinct; every axis where the operand is absent or empty, or `None`
/// (the op is the identity) there when `noop_with_empty_axes` is set. Type inference, the CPU
/// kernels and the CUDA plans all read a reduction's axes through this.
pub fn reduce_axes(
    axes: Option<&[i64]>,
    rank: usize,
    noop_with_empty_axes: bool,
) -> Result<Option<Vec<usize>>, String> {
    match axes {
        Some(v) if !v.is_empty() => {
            let mut out = v
                .iter()
                .map(|&a| normalize_axis(a, rank).ok_or_else(|| format!("axis {a} out of range for rank {rank}")))
                .collect::<Result<Vec<_>, _>>()?;
            out.sort_unstable();
            if out.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("axes {v:?} repeat an axis"));
            }
            Ok(Some(out))
        }
        _ if noop_with_empty_axes => Ok(None),
        _ => Ok(Some((0..rank).collect())),
    }
}

/// ONNX `auto_pad`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AutoPad {
    /// Explicit `pads`.
    #[default]
    NotSet,
    /// Output size `ceil(n / stride)`, the odd pad at the end.
    SameUpper,
    /// Output size `ceil(n / stride)`, the odd pad at the beginning.
    SameLower,
    /// No padding.
    Valid,
}

impl AutoPad {
    pub const NAMES: [(&'static str, AutoPad); 4] = [
        ("NOTSET", AutoPad::NotSet),
        ("SAME_UPPER", AutoPad::SameUpper),
        ("SAME_LOWER", AutoPad::SameLower),
        ("VALID", AutoPad::Valid),
    ];

    pub fn is_same(self) -> bool {
        matches!(self, AutoPad::SameUpper | AutoPad::SameLower)
    }

    /// Splits a total padding between beginning and end as the mode says.
    fn split(self, total: u128) -> (u128, u128) {
        let small = total / 2;
        match self {
            AutoPad::SameLower => (total - small, small),
            _ => (small, total - small),
        }
    }
}

/// One spatial dim of a window: the output size and the padding before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowDim {
    pub out: u64,
    pub pad_begin: u64,
    pub pad_end: u64,
}

/// The attributes of a convolution or pooling window, as given (missing entries take their
/// defaults: stride and dilation 1, pads 0).
#[derive(Clone, Copy, Debug)]
pub struct WindowSpec<'a> {
    pub kernel: &'a [i64],
    pub strides: &'a [i64],
    pub dilations: &'a [i64],
    /// `[begin..., end...]`.
    pub pads: &'a [i64],
    pub auto_pad: AutoPad,
    pub ceil_mode: bool,
    /// A pooling window: one larger than the padded input is not an error while onnx shape
    /// inference and onnxruntime give it outputs (their C division, rounding toward zero:
    /// `(padded - window) / stride + 1`, which is 0, or 1 when the shortfall is below the stride;
    /// with ceil_mode the quotient rounds up). A window's taps past the input are padding.
    pub pool: bool,
}

/// A window resolved for one input: everything a kernel needs, per spatial dim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub kernel: Vec<usize>,
    pub strides: Vec<usize>,
    pub dilations: Vec<usize>,
    pub pads_begin: Vec<usize>,
    pub pads_end: Vec<usize>,
    pub out: Vec<usize>,
}

impl WindowSpec<'_> {
    fn get(v: &[i64], i: usize, default: i64) -> i64 {
        v.get(i).copied().unwrap_or(default)
    }

    /// Stride, dilation, kernel and the explicit pads of spatial dim `i`, checked.
    fn dim(&self, i: usize) -> Result<(u64, u64, u64, (i64, i64)), String> {
        let sp = self.kernel.len();
        let (k, s, d) = (self.kernel[i], Self::get(self.strides, i, 1), Self::get(self.dilations, i, 1));
        if k < 1 || s < 1 || d < 1 {
            return Err(format!("kernel {k}, stride {s} and dilation {d} must all be at least 1"));
        }
        let pads = (Self::get(self.pads, i, 0), Self::get(self.pads, i + sp, 0));
        if pads.0 < 0 || pads.1 < 0 {
            return Err(format!("pads {pads:?} must not be negative"));
        }
        Ok((k as u64, s as u64, d as u64, pads))
    }

    /// The output size and pads of spatial dim `i` for an input of size `n`.
    ///
    /// The padded size must fit an i64: every coordinate a kernel computes (a window's start plus
    /// one of its taps) is below it, so no kernel overflows on a kernel, stride, dilation or pad of
    /// any size. The arithmetic here is in u128 for the same reason.
    pub fn out_dim(&self, i: usize, n: u64) -> Result<WindowDim, String> {
        let (k, s, d, (pb, pe)) = self.dim(i)?;
        let (n, k, s, d) = (n as u128, k as u128, s as u128, d as u128);
        let ek = (k - 1) * d + 1;
        let (out, pad_begin, pad_end) = match self.auto_pad {
            AutoPad::SameUpper | AutoPad::SameLower => {
                let out = n.div_ceil(s);
                let total = (out.saturating_sub(1) * s + ek).saturating_sub(n);
                let (pad_begin, pad_end) = self.auto_pad.split(total);
                (out, pad_begin, pad_end)
            }
            AutoPad::Valid | AutoPad::NotSet => {
                let (pb, pe) = if self.auto_pad == AutoPad::Valid { (0, 0) } else { (pb as u128, pe as u128) };
                let padded = n + pb + pe;
                let mut out = if padded >= ek {
                    let span = padded - ek;
                    if self.ceil_mode {
                        span.div_ceil(s) + 1
                    } else {
                        span / s + 1
                    }
                } else {
                    // A negative span over the stride, rounded toward zero (ceil_mode's rounding
                    // up is the same for a negative quotient), plus one: 1 while the window is
                    // short of the padded input by less than a stride, then 0, then an error.
                    let short = ek - padded;
                    if !self.pool || short >= 2 * s {
                        return Err(format!("a window of {ek} does not fit input size {n} with pads {pb}+{pe}"));
                    }
                    1 - short / s
                };
                // ceil_mode: the last window must start inside the input or its left padding.
                if self.ceil_mode && out > 0 && (out - 1) * s >= n + pb {
                    out -= 1;
                }
                (out, pb, pe)
            }
        };
        if n + pad_begin + pad_end > i64::MAX as u128 {
            return Err(format!(
                "a window of {ek} (kernel {k}, dilation {d}) on input size {n} with pads {pad_begin}+{pad_end} is too large"
            ));
        }
        Ok(WindowDim { out: out as u64, pad_begin: pad_begin as u64, pad_end: pad_end as u64 })
    }

    /// Resolves the window for the spatial sizes `input`.
    pub fn resolve(&self, input: &[usize]) -> Result<Window, String> {
        let sp = self.kernel.len();
        if input.len() != sp {
            return Err(format!("a {sp}-D window on {} spatial dims", input.len()));
        }
        let mut w = Window {
            kernel: Vec::with_capacity(sp),
            strides: Vec::with_capacity(sp),
            dilations: Vec::with_capacity(sp),
            pads_begin: Vec::with_capacity(sp),
            pads_end: Vec::with_capacity(sp),
            out: Vec::with_capacity(sp),
        };
        for (i, &n) in input.iter().enumerate() {
            let (k, s, d, _) = self.dim(i)?;
            let o = self.out_dim(i, n as u64)?;
            w.kernel.push(k as usize);
            w.strides.push(s as usize);
            w.dilations.push(d as usize);
            w.pads_begin.push(o.pad_begin as usize);
            w.pads_end.push(o.pad_end as usize);
            w.out.push(o.out as usize);
        }
        Ok(w)
    }

    /// The output dims of spatial dims that may be symbolic: unknown where the input is.
    pub fn out_dims(&self, input: &[Dim]) -> Result<Vec<Dim>, String> {
        let sp = self.kernel.len();
        if input.len() != sp {
            return Err(format!("a {sp}-D window on {} spatial dims", input.len()));
        }
        input
            .iter()
            .enumerate()
            .map(|(i, d)| match d.fixed() {
                Some(n) => self.out_dim(i, n).map(|o| Dim::Fixed(o.out)),
                None => self.dim(i).map(|_| Dim::Unknown),
            })
            .collect()
    }
}

/// One spatial dim of a ConvTranspose: the output size and the pads cut from the full result.
/// `target` is the `output_shape` attribute's entry for this dim, when given.
pub fn conv_transpose_dim(
    spec: &WindowSpec,
    i: usize,
    n: u64,
    output_padding: i64,
    target: Option<i64>,
) -> Result<WindowDim, String> {
    let (k, s, d, (pb, pe)) = spec.dim(i)?;
    if output_padding < 0 {
        return Err(format!("output_padding {output_padding} must not be negative"));
    }
    if n == 0 {
        return Err("ConvTranspose on an empty spatial dim".into());
    }
    // In u128, and bounded like a window's padded size (see `WindowSpec::out_dim`).
    let full = s as u128 * (n as u128 - 1) + output_padding as u128 + (k as u128 - 1) * d as u128 + 1;
    let same = n as u128 * s as u128;
    if full > i64::MAX as u128 || (spec.auto_pad.is_same() && same > i64::MAX as u128) {
        return Err(format!("a ConvTranspose of input size {n}, stride {s}, kernel {k} and dilation {d} is too large"));
    }
    let full = full as u64;
    let target = match target {
        Some(t) if t < 0 => return Err(format!("output_shape entry {t} is negative")),
        Some(t) => Some(t as u64),
        // SAME: `n * stride`, cut from the full result; a kernel extent below the stride makes the
        // full result shorter than that, and it is kept whole (onnxruntime's output and onnx's
        // shape inference; the reference evaluator pads it instead).
        None if spec.auto_pad.is_same() => Some((same as u64).min(full)),
        None => None,
    };
    Ok(match target {
        Some(t) => {
            // The cut that reaches the target; SAME_UPPER cuts the odd one at the end.
            let total = full.saturating_sub(t);
            let (pad_begin, pad_end) = match spec.auto_pad {
                AutoPad::SameUpper => (total / 2, total - total / 2),
                _ => (total - total / 2, total / 2),
            };
            WindowDim { out: t, pad_begin, pad_end }
        }
        None => {
            let (pb, pe) = if spec.auto_pad == AutoPad::Valid { (0, 0) } else { (pb as u64, pe as u64) };
            if pb + pe > full {
                return Err(format!("pads {pb}+{pe} exceed the output size {full}"));
            }
            WindowDim { out: full - pb - pe, pad_begin: pb, pad_end: pe }
        }
    })
}

/// The input coordinate of output coordinate `x` along one Resize axis; `roi` is the axis's
/// region of interest (start, end), which only tf_crop_and_resize reads.
fn resize_source(mode: CoordinateMode, x: f64, scale: f64, in_len: usize, out_len: usize, roi: [f64; 2]) -> f64 {
    match mode {
        CoordinateMode::HalfPixel => (x + 0.5) / scale - 0.5,
        CoordinateMode::HalfPixelSymmetric => {
            let adj = out_len as f64 / (scale * in_len as f64);
            let center = in_len as f64 / 2.0;
            let offset = center * (1.0 - adj);
            offset + (x + 0.5) / scale - 0.5
        }
        CoordinateMode::PytorchHalfPixel => {
            if out_len > 1 {
                (x + 0.5) / scale - 0.5
            } else {
                0.0
            }
        }
        CoordinateMode::AlignCorners => {
            if out_len > 1 {
                x * (in_len as f64 - 1.0) / (out_len as f64 - 1.0)
            } else {
                0.0
            }
        }
        CoordinateMode::Asymmetric => x / scale,
        // In float32, in onnxruntime's order: a coordinate that lands on an end of the input
        // (where extrapolation starts) lands there as it does in onnxruntime.
        CoordinateMode::TfCropAndResize => {
            let (start, end, n, m) = (roi[0] as f32, roi[1] as f32, in_len as f32, out_len as f32);
            let s = if out_len > 1 {
                start * (n - 1.0) + (x as f32 * (end - start) * (n - 1.0)) / (m - 1.0)
            } else {
                (0.5 * f64::from(start + end) * f64::from(n - 1.0)) as f32
            };
            f64::from(s)
        }
    }
}

/// Resize's region of interest per axis of a rank-`rank` input: `[start, end]` from `roi`
/// (starts then ends, one each for the axes the `axes` attribute names, all by default), `[0, 1]`
/// for the other axes. Only tf_crop_and_resize reads it (a missing or empty roi is an error
/// there); every other mode gets `[0, 1]` everywhere.
pub fn resize_roi(a: &ResizeAttrs, rank: usize, roi: Option<&[f64]>) -> Result<Vec<[f64; 2]>, String> {
    let mut out = vec![[0.0, 1.0]; rank];
    if a.coordinate_transformation_mode != CoordinateMode::TfCropAndResize {
        return Ok(out);
    }
    let axes: Vec<usize> = if a.axes.is_empty() {
        (0..rank).collect()
    } else {
        a.axes.iter().map(|&d| normalize_axis(d, rank).ok_or("axis out of range")).collect::<Result<_, _>>()?
    };
    let roi = roi.filter(|r| !r.is_empty()).ok_or("tf_crop_and_resize needs the roi input")?;
    if roi.len() != 2 * axes.len() {
        return Err(format!("roi has {} values where {} axes need {}", roi.len(), axes.len(), 2 * axes.len()));
    }
    for (i, &ax) in axes.iter().enumerate() {
        out[ax] = [roi[i], roi[axes.len() + i]];
    }
    Ok(out)
}

fn resize_nearest(mode: NearestMode, v: f64) -> f64 {
    match mode {
        NearestMode::Floor => v.floor(),
        NearestMode::Ceil => v.ceil(),
        NearestMode::RoundPreferCeil => (v + 0.5).floor(),
        NearestMode::RoundPreferFloor => {
            // round_prefer_floor: halves go down.
            if v.fract() == 0.5 {
                v.floor()
            } else {
                v.round()
            }
        }
    }
}

/// A Resize output size from a scale: `floor(n · scale)` with the product in float32, as
/// onnxruntime and the onnx reference evaluator take it and as torch's `interpolate` sized the
/// export (30 × 1.3f is 39, where the exact product of 1.2999999523 is 38.99999857); `None` when
/// it does not fit an i64.
pub fn scaled_dim(n: u64, scale: f64) -> Option<u64> {
    let v = ((n as f32) * (scale as f32)).floor() as f64;
    (v >= 0.0 && v < 2f64.powi(63)).then_some(v as u64)
}

/// Resize's output size and scale along each axis of an input shaped `shape`: from `sizes` when
/// given and not empty (with `keep_aspect_ratio_policy`, one scale for all the named axes), else from
/// `scales` (output [`scaled_dim`]), for the axes the `axes`
/// attribute names (all by default); the other axes keep their size at scale 1.
pub fn resize_plan(
    a: &ResizeAttrs,
    shape: &[usize],
    scales: Option<&[f64]>,
    sizes: Option<&[i64]>,
) -> Result<(Vec<usize>, Vec<f64>), String> {
    let rank = shape.len();
    let axes: Vec<usize> = if a.axes.is_empty() {
        (0..rank).collect()
    } else {
        a.axes.iter().map(|&d| normalize_axis(d, rank).ok_or("axis out of range")).collect::<Result<_, _>>()?
    };
    let (mut out, mut scale) = (shape.to_vec(), vec![1f64; rank]);
    match (sizes.filter(|s| !s.is_empty()), scales.filter(|s| !s.is_empty())) {
        (Some(s), _) if a.keep_aspect_ratio_policy != AspectPolicy::Stretch => {
            // One scale for every named axis, the smallest (not_larger) or the largest
            // (not_smaller) of sizes / input; each size then round(scale · input), halves up.
            let ratios = axes.iter().zip(s).map(|(&ax, &m)| m as f64 / shape[ax] as f64);
            let f = match a.keep_aspect_ratio_policy {
                AspectPolicy::NotLarger => ratios.fold(f64::INFINITY, f64::min),
                _ => ratios.fold(f64::NEG_INFINITY, f64::max),
            };
            for &ax in &axes {
                out[ax] = (f * shape[ax] as f64 + 0.5).floor().max(0.0) as usize;
                scale[ax] = f;
            }
        }
        (Some(s), _) => {
            for (&ax, &m) in axes.iter().zip(s) {
                out[ax] = m.max(0) as usize;
                scale[ax] = m as f64 / shape[ax] as f64;
            }
        }
        (None, Some(s)) => {
            for (&ax, &f) in axes.iter().zip(s) {
                out[ax] = scaled_dim(shape[ax] as u64, f).ok_or("a scaled dim overflows")? as usize;
                scale[ax] = f;
            }
        }
        _ => return Err("Resize needs scales or sizes".into()),
    }
    if let Some(ax) = (0..rank).find(|&d| shape[d] == 0 && out[d] > 0) {
        return Err(format!(
            "axis {ax} of the input is empty and cannot be resized to {} (nothing to sample)",
            out[ax]
        ));
    }
    Ok((out, scale))
}

/// Resize's sampling along one axis from `n` inputs to `m` outputs at `scale` (and `roi`, see
/// [`resize_roi`]): each output's (input index, weight) taps, one for nearest, two for linear,
/// four for cubic, and as many as the widened filter covers with antialias ([`filter_taps`]). An
/// axis kept at its size and scale 1 (and the whole of its roi) is the identity. With
/// tf_crop_and_resize, an output whose source lies outside the input has no taps: it is the
/// `extrapolation_value` (the kernels' rule: an output any axis gives no taps).
pub fn resize_taps(
    a: &ResizeAttrs,
    n: usize,
    m: usize,
    scale: f64,
    roi: [f64; 2],
) -> Result<Vec<Vec<(usize, f64)>>, String> {
    if a.antialias && a.mode == ResizeMode::Nearest {
        return Err("Resize with antialias in nearest mode (the spec has it for linear and cubic only)".into());
    }
    let crop = a.coordinate_transformation_mode == CoordinateMode::TfCropAndResize;
    let mut per = Vec::with_capacity(m);
    for o in 0..m {
        if n == m && scale == 1.0 && (!crop || roi == [0.0, 1.0]) {
            per.push(vec![(o, 1.0)]);
            continue;
        }
        let s = resize_source(a.coordinate_transformation_mode, o as f64, scale, n, m, roi);
        if crop && !(0.0..=n as f64 - 1.0).contains(&s) {
            per.push(Vec::new());
            continue;
        }
        per.push(if a.mode == ResizeMode::Nearest {
            vec![(resize_nearest(a.nearest_mode, s).clamp(0.0, n as f64 - 1.0) as usize, 1.0)]
        } else if a.mode == ResizeMode::Cubic || a.antialias {
            filter_taps(a, s, n, scale)
        } else {
            let s = s.clamp(0.0, n as f64 - 1.0);
            let i0 = s.floor() as usize;
            let i1 = (i0 + 1).min(n - 1);
            let w = s - i0 as f64;
            vec![(i0, 1.0 - w), (i1, w)]
        });
    }
    Ok(per)
}

/// Cubic taps, and linear or cubic with antialias, as the ONNX reference evaluator takes them:
/// the `2 - 2·start` inputs nearest the source coordinate `s` (those left of it preferred: `base`
/// is the input left of `s`, `s` itself counting as right of it), `start = floor(-r / c) + 1` for
/// the kernel's reach r (1 linear, 2 cubic) and c = min(scale, 1) with antialias (1 without);
/// each weighs kernel(c · (offset − (s − base))) — the triangle, or Keys' cubic with a =
/// `cubic_coeff_a` — divided by their sum with antialias. An input past either end is the edge
/// one (or, with `exclude_outside`, weighs 0 and the rest are renormalised).
fn filter_taps(a: &ResizeAttrs, s: f64, n: usize, scale: f64) -> Vec<(usize, f64)> {
    let cubic = a.mode == ResizeMode::Cubic;
    let base = if s.fract() == 0.0 { s - 1.0 } else { s.floor() };
    let ratio = s - base;
    let c = if a.antialias { scale.min(1.0) } else { 1.0 };
    let reach = if cubic { 2.0 } else { 1.0 };
    let start = (-reach / c).floor() as i64 + 1;
    let k = f64::from(a.cubic_coeff_a);
    let kernel = |x: f64| {
        let x = x.abs();
        match (cubic, x) {
            (false, _) => (1.0 - x).max(0.0),
            (true, x) if x <= 1.0 => ((k + 2.0) * x - (k + 3.0)) * x * x + 1.0,
            (true, x) if x < 2.0 => ((k * x - 5.0 * k) * x + 8.0 * k) * x - 4.0 * k,
            _ => 0.0,
        }
    };
    let mut taps: Vec<(i64, f64)> =
        (start..1 - start + 1).map(|off| (base as i64 + off, kernel(c * (off as f64 - ratio)))).collect();
    let inside = |i: i64| (0..n as i64).contains(&i);
    if a.exclude_outside {
        taps.iter_mut().filter(|t| !inside(t.0)).for_each(|t| t.1 = 0.0);
    }
    if a.antialias || a.exclude_outside {
        let sum: f64 = taps.iter().map(|t| t.1).sum();
        taps.iter_mut().for_each(|t| t.1 /= sum);
    }
    taps.into_iter().map(|(i, w)| (i.clamp(0, n as i64 - 1) as usize, w)).collect()
}

/// The element of an axis of `n` that Pad reads for coordinate `c` (the output's less the pad
/// before it): `c` inside the axis; outside it, reflect mirrors about the ends (again and again, as
/// numpy), edge repeats the end (reflect too when `n` is 1), wrap goes round; `None` for the constant
/// (constant mode, or an empty axis).
pub fn pad_source(c: i64, n: i64, mode: crate::ops::PadMode) -> Option<i64> {
    use crate::ops::PadMode;
    if (0..n).contains(&c) {
        return Some(c);
    }
    if n == 0 {
        return None;
    }
    Some(match mode {
        PadMode::Constant => return None,
        PadMode::Reflect if n > 1 => {
            let period = 2 * (n - 1);
            let m = c.rem_euclid(period);
            if m >= n {
                period - m
            } else {
                m
            }
        }
        PadMode::Edge | PadMode::Reflect => c.clamp(0, n - 1),
        PadMode::Wrap => c.rem_euclid(n),
    })
}

/// The start and element count of a slice of a dim of `len` elements (ONNX Slice clamping:
/// negative indices count from the end; a positive step clamps start and end to `[0, len]`; a
/// negative one clamps the start to `[0, len-1]` (a start before the first element is the first
/// element, as onnxruntime has it) and the end to `[-1, len-1]`).
pub fn slice_dim(len: i64, start: i64, end: i64, step: i64) -> Result<(i64, u64), String> {
    if step == 0 {
        return Err("slice step is 0".into());
    }
    if len == 0 {
        return Ok((0, 0));
    }
    let norm = |v: i64| if v < 0 { v.saturating_add(len) } else { v };
    let (b, e) = if step > 0 {
        (norm(start).clamp(0, len), norm(end).clamp(0, len))
    } else {
        (norm(start).clamp(0, len - 1), norm(end).clamp(-1, len - 1))
    };
    let span = if step > 0 { e - b } else { b - e };
    Ok((b, (span.max(0) as u64).div_ceil(step.unsigned_abs())))
}

/// Numpy broadcasting of concrete shapes; `None` if they do not broadcast.
pub fn broadcast_shape(shapes: &[&[usize]]) -> Option<Vec<usize>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; rank];
    for s in shapes {
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[rank - s.len() + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return None;
            }
        }
    }
    Some(out)
}

/// The element strides with which an input of `shape` is read when broadcast to `out`: one per
/// output dim, 0 where the input repeats.
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let rank = out.len();
    let mut strides = vec![0usize; rank];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        let o = rank - shape.len() + i;
        strides[o] = if shape[i] == 1 { 0 } else { acc };
        acc *= shape[i];
    }
    strides
}

/// Numpy broadcasting with symbolic dims: a fixed dim other than 1 wins over a symbolic one, two
/// different symbols give an unknown dim.
pub fn broadcast_dims(shapes: &[&Shape]) -> Result<Shape, String> {
    let rank = shapes.iter().map(|s| s.rank()).max().unwrap_or(0);
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let mut d = Dim::Fixed(1);
        for s in shapes {
            let Some(pos) = (i + s.rank()).checked_sub(rank) else {
                continue;
            };
            let e = &s.0[pos];
            d = match (&d, e) {
                (Dim::Fixed(1), _) => e.clone(),
                (_, Dim::Fixed(1)) => d,
                (Dim::Fixed(a), Dim::Fixed(b)) if a != b => {
                    let list: Vec<String> = shapes.iter().map(|s| s.to_string()).collect();
                    return Err(format!("shapes {} cannot be broadcast", list.join(" and ")));
                }
                (Dim::Fixed(_), _) => d,
                (_, Dim::Fixed(_)) => e.clone(),
                (Dim::Sym(a), Dim::Sym(b)) if a == b => d,
                _ => Dim::Unknown,
            };
        }
        out.push(d);
    }
    Ok(Shape(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(
        kernel: &'a [i64],
        strides: &'a [i64],
        pads: &'a [i64],
        auto_pad: AutoPad,
        ceil: bool,
    ) -> WindowSpec<'a> {
        WindowSpec { kernel, strides, dilations: &[], pads, auto_pad, ceil_mode: ceil, pool: true }
    }

    #[test]
    fn ceil_mode_keeps_a_last_window_that_starts_in_the_input() {
        // MaxPool[ceil_mode=1, kernel 2, pads [1,0], stride 2] on 4 elements: windows start at
        // padded positions 0, 2, 4; the last starts at input index 3, inside the input.
        let w = spec(&[2], &[2], &[1, 0], AutoPad::NotSet, true).resolve(&[4]).unwrap();
        assert_eq!(w.out, [3]);
        // Without the left pad the third window would start past the input.
        let w = spec(&[2], &[2], &[0, 1], AutoPad::NotSet, true).resolve(&[4]).unwrap();
        assert_eq!(w.out, [2]);
        assert_eq!(spec(&[3], &[2], &[0, 0], AutoPad::NotSet, true).resolve(&[6]).unwrap().out, [3]);
        assert_eq!(spec(&[3], &[2], &[0, 0], AutoPad::NotSet, false).resolve(&[6]).unwrap().out, [2]);
    }

    #[test]
    fn same_padding_puts_the_odd_pad_where_the_mode_says() {
        let up = spec(&[4], &[1], &[], AutoPad::SameUpper, false).resolve(&[5]).unwrap();
        assert_eq!((up.out[0], up.pads_begin[0], up.pads_end[0]), (5, 1, 2));
        let low = spec(&[4], &[1], &[], AutoPad::SameLower, false).resolve(&[5]).unwrap();
        assert_eq!((low.out[0], low.pads_begin[0], low.pads_end[0]), (5, 2, 1));
        assert_eq!(spec(&[3], &[2], &[], AutoPad::Valid, false).resolve(&[7]).unwrap().out, [3]);
    }

    #[test]
    fn zero_strides_and_oversized_windows_are_errors() {
        assert!(spec(&[2], &[0], &[], AutoPad::NotSet, false).resolve(&[4]).unwrap_err().contains("stride 0"));
        // A pool's window past the padded input: onnx shape inference's and onnxruntime's sizes.
        assert_eq!(spec(&[5], &[1], &[], AutoPad::NotSet, false).resolve(&[4]).unwrap().out, [0]);
        assert_eq!(spec(&[5], &[2], &[], AutoPad::NotSet, false).resolve(&[4]).unwrap().out, [1]);
        assert_eq!(spec(&[7], &[2], &[], AutoPad::NotSet, true).resolve(&[4]).unwrap().out, [0]);
        assert_eq!(spec(&[6], &[3], &[1, 0], AutoPad::NotSet, true).resolve(&[4]).unwrap().out, [1]);
        assert!(spec(&[6], &[1], &[], AutoPad::NotSet, false).resolve(&[4]).is_err());
        let conv = WindowSpec { pool: false, ..spec(&[5], &[1], &[], AutoPad::NotSet, false) };
        assert!(conv.resolve(&[4]).is_err());
        assert!(spec(&[2], &[1], &[-1, 0], AutoPad::NotSet, false).resolve(&[4]).is_err());
    }

    #[test]
    fn conv_transpose_sizes() {
        let s = spec(&[3], &[2], &[1, 1], AutoPad::NotSet, false);
        assert_eq!(conv_transpose_dim(&s, 0, 3, 1, None).unwrap(), WindowDim { out: 6, pad_begin: 1, pad_end: 1 });
        let same = spec(&[3], &[2], &[], AutoPad::SameUpper, false);
        assert_eq!(conv_transpose_dim(&same, 0, 3, 0, None).unwrap().out, 6);
        assert_eq!(conv_transpose_dim(&s, 0, 3, 0, Some(5)).unwrap().out, 5);
        // Kernel 1 below stride 3: the full 7, not 3 * 3.
        let short = spec(&[1], &[3], &[], AutoPad::SameLower, false);
        assert_eq!(conv_transpose_dim(&short, 0, 3, 0, None).unwrap(), WindowDim { out: 7, pad_begin: 0, pad_end: 0 });
    }

    #[test]
    fn slices_clamp_as_onnx_says() {
        assert_eq!(slice_dim(10, 2, 5, 1).unwrap(), (2, 3));
        assert_eq!(slice_dim(10, -3, i64::MAX, 1).unwrap(), (7, 3));
        assert_eq!(slice_dim(10, i64::MAX, i64::MIN, -1).unwrap(), (9, 10));
        assert_eq!(slice_dim(10, 5, 2, 1).unwrap(), (5, 0));
        assert_eq!(slice_dim(10, 0, 10, 3).unwrap(), (0, 4));
        assert!(slice_dim(10, 0, 10, 0).is_err());
        // A negative step from before the first element starts at the first element.
        assert_eq!(slice_dim(10, -15, i64::MIN, -1).unwrap(), (0, 1));
        assert_eq!(slice_dim(10, -15, -20, -2).unwrap(), (0, 1));
        assert_eq!(slice_dim(0, -1, i64::MIN, -1).unwrap(), (0, 0));
    }

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast_shape(&[&[3, 1, 5], &[4, 5]]), Some(vec![3, 4, 5]));
        assert_eq!(broadcast_shape(&[&[3], &[4]]), None);
        assert_eq!(broadcast_strides(&[3, 1, 5], &[2, 3, 4, 5]), vec![0, 5, 0, 1]);
        let s = broadcast_dims(&[&Shape(vec![Dim::sym("b"), Dim::Fixed(1)]), &Shape(vec![Dim::Fixed(7)])]).unwrap();
        assert_eq!(s, Shape(vec![Dim::sym("b"), Dim::Fixed(7)]));
    }
}
