//! Measured value ranges: what FP16 and BF16 would do to every float value of a model, on sample
//! data, before anything is run in low precision.
//!
//! [`measure`] runs the FP32 model over batches of a data file with every float value an output,
//! and records per value: the element and non-zero counts, max |x| and the smallest non-zero |x|,
//! how many non-zeros FP16 and BF16 would flush to zero and how many they would overflow, NaN and
//! Inf counts, and a histogram of log2 |x|. [`Ranges::at_risk`] says which values a policy's low
//! dtype breaks (any overflow, or more than 1% of the non-zeros flushed) and why, in the words
//! `--explain` prints; calibration pins the nodes that compute them to FP32.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mpc_ir::{DType, Graph};
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The histogram's buckets: floor(log2 |x|) from `HIST_MIN` to `HIST_MAX` (clamped at both ends).
pub const HIST_MIN: i32 = -80;
pub const HIST_MAX: i32 = 40;

/// A flushed share above this is harm (1% of the non-zeros).
pub const FLUSH_LIMIT: f64 = 0.01;

/// What one value held over the batches measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ValueRange {
    pub count: u64,
    pub nonzero: u64,
    pub max_abs: f64,
    /// The smallest non-zero |x| (none when every element was zero).
    pub min_nonzero: Option<f64>,
    pub nan: u64,
    pub inf: u64,
    pub f16_flushed: u64,
    pub f16_overflow: u64,
    pub bf16_flushed: u64,
    pub bf16_overflow: u64,
    /// Non-zero finite elements by floor(log2 |x|), from [`HIST_MIN`].
    pub log2_hist: Vec<u64>,
}

impl Default for ValueRange {
    fn default() -> Self {
        ValueRange {
            count: 0,
            nonzero: 0,
            max_abs: 0.0,
            min_nonzero: None,
            nan: 0,
            inf: 0,
            f16_flushed: 0,
            f16_overflow: 0,
            bf16_flushed: 0,
            bf16_overflow: 0,
            log2_hist: vec![0; (HIST_MAX - HIST_MIN + 1) as usize],
        }
    }
}

impl ValueRange {
    fn add(&mut self, xs: &[f32]) {
        // Rounding to nearest (ties to even) flushes |x| ≤ half the smallest subnormal and
        // overflows |x| ≥ the largest finite value plus half an ulp; checked against the `half`
        // crate's conversions in the tests.
        const F16_FLUSH: f32 = 2.980_232_2e-8; // 2^-25
        const F16_OVERFLOW: f32 = 65520.0;
        const BF16_FLUSH_BITS: u32 = 0x0000_8000; // 2^-134, an f32 subnormal
        const BF16_OVERFLOW_BITS: u32 = 0x7F7F_8000;
        self.count += xs.len() as u64;
        let mut max_abs = 0f32;
        let mut min_nonzero = f32::INFINITY;
        for &x in xs {
            let bits = x.to_bits() & 0x7FFF_FFFF;
            if bits >= 0x7F80_0000 {
                if bits > 0x7F80_0000 {
                    self.nan += 1;
                } else {
                    self.inf += 1;
                }
                continue;
            }
            if bits == 0 {
                continue;
            }
            let a = f32::from_bits(bits);
            self.nonzero += 1;
            max_abs = max_abs.max(a);
            min_nonzero = min_nonzero.min(a);
            self.f16_flushed += u64::from(a <= F16_FLUSH);
            self.f16_overflow += u64::from(a >= F16_OVERFLOW);
            self.bf16_flushed += u64::from(bits <= BF16_FLUSH_BITS);
            self.bf16_overflow += u64::from(bits >= BF16_OVERFLOW_BITS);
            // floor(log2 a) from the exponent bits (subnormals: from the leading zeros).
            let exp = (bits >> 23) as i32;
            let log2 = if exp == 0 { -127 - ((bits << 9).leading_zeros() as i32) } else { exp - 127 };
            self.log2_hist[(log2.clamp(HIST_MIN, HIST_MAX) - HIST_MIN) as usize] += 1;
        }
        if max_abs > 0.0 {
            self.max_abs = self.max_abs.max(f64::from(max_abs));
            self.min_nonzero = Some(self.min_nonzero.map_or(f64::from(min_nonzero), |m| m.min(f64::from(min_nonzero))));
        }
    }

    /// (flushed, overflowing) non-zeros in `low`.
    pub fn lost(&self, low: DType) -> (u64, u64) {
        match low {
            DType::BF16 => (self.bf16_flushed, self.bf16_overflow),
            _ => (self.f16_flushed, self.f16_overflow),
        }
    }

    /// The share of the non-zeros `low` flushes to zero.
    pub fn flushed_share(&self, low: DType) -> f64 {
        self.lost(low).0 as f64 / self.nonzero.max(1) as f64
    }

    /// Why `low` breaks this value, if it does: an overflow, or more than 1% of the non-zeros
    /// flushed.
    pub fn harm(&self, low: DType) -> Option<String> {
        let (_, overflow) = self.lost(low);
        let (name, max, tiny) = match low {
            DType::BF16 => ("BF16", "3.39e38", "2^-133"),
            _ => ("FP16", "65504", "2^-24"),
        };
        if overflow > 0 {
            return Some(format!("max |x| {:.3e} > {max}: {overflow} values would overflow {name}", self.max_abs));
        }
        let share = self.flushed_share(low);
        (share > FLUSH_LIMIT).then(|| {
            format!(
                "{:.1}% of the non-zeros (min |x| {:.2e}) are below {name}'s smallest subnormal {tiny}",
                100.0 * share,
                self.min_nonzero.unwrap_or(0.0)
            )
        })
    }

    /// A number that orders harms: overflows first, then the share flushed.
    fn severity(&self, low: DType) -> f64 {
        let (_, overflow) = self.lost(low);
        if overflow > 0 {
            1.0 + overflow as f64
        } else {
            self.flushed_share(low)
        }
    }
}

/// The ranges of every float value of a model.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Ranges {
    /// Batches and samples measured.
    pub batches: usize,
    pub samples: usize,
    pub values: BTreeMap<String, ValueRange>,
    /// Of a training graph's values (`--train`, loss scale 1): the activations' gradients, and
    /// every value the backward pass computes (all of which a loss scale multiplies).
    #[serde(default)]
    pub activation_gradients: Vec<String>,
    #[serde(default)]
    pub backward: Vec<String>,
}

/// The paper's Figure 3 for a model: the activation gradients' magnitudes at loss scale 1.
#[derive(Clone, Debug, PartialEq)]
pub struct GradientHistogram {
    pub values: u64,
    pub zeros: u64,
    /// Non-zero finite gradients by floor(log2 |g|), from [`HIST_MIN`].
    pub log2_hist: Vec<u64>,
    /// The largest |x| of any backward value (what a scale must not push past 65504).
    pub max_backward: f64,
}

impl GradientHistogram {
    pub fn nonzero(&self) -> u64 {
        self.log2_hist.iter().sum()
    }

    /// Non-zeros below 2^`exp`.
    pub fn below(&self, exp: i32) -> u64 {
        let end = ((exp - HIST_MIN).max(0) as usize).min(self.log2_hist.len());
        self.log2_hist[..end].iter().sum()
    }

    /// The share of the non-zeros that FP16 loses (below its smallest subnormal, 2^-24) at
    /// loss scale 2^`k`.
    pub fn lost_at(&self, k: i32) -> f64 {
        self.below(-24 - k) as f64 / self.nonzero().max(1) as f64
    }

    /// The smallest power of two that lifts every non-zero gradient to 2^-24 or above.
    pub fn smallest_lossless(&self) -> Option<i32> {
        let first = self.log2_hist.iter().position(|&c| c > 0)? as i32 + HIST_MIN;
        Some(-24 - first)
    }

    /// The largest power of two that keeps every backward value below 65504.
    pub fn largest_safe(&self) -> Option<i32> {
        (self.max_backward > 0.0).then(|| (65504.0 / self.max_backward).log2().floor() as i32)
    }

    /// The scale `--loss-scale auto` starts dynamic scaling at: one halving below the largest
    /// safe scale (later batches' gradients differ from the measured ones), and never below the
    /// smallest lossless one when that fits.
    pub fn auto_scale(&self) -> i32 {
        match (self.smallest_lossless(), self.largest_safe()) {
            (Some(lo), Some(hi)) => (hi - 1).max(lo.min(hi)),
            (None, Some(hi)) => hi - 1,
            _ => 16,
        }
    }

    /// The histogram as text: one line per power of two, with FP16's ranges marked.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let nz = self.nonzero();
        let mut s = format!(
            "activation gradients at loss scale 1: {} values, {:.1}% zero; of the non-zeros {:.2}% are below 2^-24 \
             (lost in FP16 without scaling), {:.2}% below 2^-14 (FP16 subnormals or lost)\n",
            self.values,
            100.0 * self.zeros as f64 / self.values.max(1) as f64,
            100.0 * self.lost_at(0),
            100.0 * self.below(-14) as f64 / nz.max(1) as f64,
        );
        if let (Some(lo), Some(hi)) = (self.smallest_lossless(), self.largest_safe()) {
            let k = self.auto_scale();
            writeln!(
                s,
                "loss scale: 2^{lo} and above loses no non-zero gradient, 2^{hi} and below overflows no backward value \
                 (max |x| {:.3e}); --loss-scale auto starts at 2^{k}, losing {:.2}%",
                self.max_backward,
                100.0 * self.lost_at(k)
            )
            .ok();
        }
        let (Some(first), Some(last)) =
            (self.log2_hist.iter().position(|&c| c > 0), self.log2_hist.iter().rposition(|&c| c > 0))
        else {
            return s;
        };
        let top = *self.log2_hist.iter().max().unwrap_or(&1) as f64;
        for (i, &c) in self.log2_hist.iter().enumerate().take(last + 1).skip(first) {
            let e = i as i32 + HIST_MIN;
            let mark = match e {
                ..=-25 => "  lost",
                -24..=-15 => "  subnormal",
                _ => "",
            };
            let bar = "#".repeat((40.0 * c as f64 / top).ceil() as usize);
            writeln!(s, "  2^{e:<4} {:>6.2}%  {bar}{mark}", 100.0 * c as f64 / nz.max(1) as f64).ok();
        }
        s
    }
}

impl Ranges {
    /// The histogram of the activation gradients (`None` for a forward-only measurement).
    pub fn gradient_histogram(&self) -> Option<GradientHistogram> {
        if self.activation_gradients.is_empty() {
            return None;
        }
        let mut h = GradientHistogram {
            values: 0,
            zeros: 0,
            log2_hist: vec![0; (HIST_MAX - HIST_MIN + 1) as usize],
            max_backward: 0.0,
        };
        for r in self.activation_gradients.iter().filter_map(|n| self.values.get(n)) {
            h.values += r.count;
            h.zeros += r.count - r.nonzero - r.nan - r.inf;
            for (a, b) in h.log2_hist.iter_mut().zip(&r.log2_hist) {
                *a += b;
            }
        }
        h.max_backward = self.backward.iter().filter_map(|n| self.values.get(n)).map(|r| r.max_abs).fold(0.0, f64::max);
        Some(h)
    }

    /// The values `low` breaks, worst first, with why.
    pub fn at_risk(&self, low: DType) -> Vec<(&str, &ValueRange, String)> {
        let mut out: Vec<(&str, &ValueRange, String)> =
            self.values.iter().filter_map(|(k, r)| Some((k.as_str(), r, r.harm(low)?))).collect();
        out.sort_by(|a, b| b.1.severity(low).total_cmp(&a.1.severity(low)).then(a.0.cmp(b.0)));
        out
    }

    pub fn read(path: &Path) -> Result<Ranges> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Output { path: path.to_owned(), source })?;
        serde_json::from_str(&text).map_err(|e| Error::Usage(format!("{}: not a ranges file: {e}", path.display())))
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Usage(e.to_string()))?;
        crate::write_atomic(path, text.as_bytes())
    }
}

/// Where calibration's ranges come from, and where they go.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    /// Sample inputs (safetensors, tensors named after the graph inputs, samples along the first
    /// dim).
    pub data: Option<PathBuf>,
    /// Saved ranges to use instead of measuring.
    pub ranges_in: Option<PathBuf>,
    /// Where to save the measured ranges.
    pub ranges_out: Option<PathBuf>,
    /// Samples per batch, and batches measured.
    pub batch: usize,
    pub batches: usize,
}

/// Runs the FP32 model `g` (loaded from `path`) over up to `batches` batches of `batch` samples of
/// `data` and measures every float value.
pub fn measure(g: &Graph, path: &Path, data: &Path, batch: usize, batches: usize) -> Result<Ranges> {
    let mut g = g.clone();
    crate::compile(&mut g, path, &crate::Options::default(), &mut |_, _| {})?;
    measure_compiled(g, path, data, batch, batches)
}

/// The ranges of the FP32 training graph's values, forward and backward, at loss scale 1 (the
/// gradients of one step, no update): what `train` would compute, before any scaling. The data
/// holds the labels too.
pub fn measure_training(
    g: &Graph,
    path: &Path,
    data: &Path,
    train: &mpc_passes::train::TrainOptions,
    batch: usize,
    batches: usize,
) -> Result<Ranges> {
    let mut g = g.clone();
    let t = mpc_passes::train::TrainOptions { loss_scale: mpc_passes::train::LossScale::None, ..train.clone() };
    let opts = crate::Options {
        train: Some(t),
        loss_scale: Some(mpc_passes::train::LossScale::None),
        stop_after: Some("autodiff".into()),
        ..Default::default()
    };
    crate::compile(&mut g, path, &opts, &mut |_, _| {})?;
    let sig = g.train.clone().unwrap_or_default();
    let activation_gradients: Vec<String> = sig.activation_grads.iter().map(|&(_, d)| g.name(d).to_string()).collect();
    // The backward values: everything computed from the seed of the backward pass.
    let seed = g.find("grad.seed");
    let mut backward = std::collections::HashSet::new();
    for n in g.topo_order().map_err(|e| Error::Usage(e.to_string()))? {
        let node = g.node(n);
        if node.inputs().iter().flatten().any(|v| Some(*v) == seed || backward.contains(v)) {
            backward.extend(node.outputs().iter().copied());
        }
    }
    let backward: Vec<String> = backward.into_iter().map(|v| g.name(v).to_string()).collect();
    let mut r = measure_compiled(g, path, data, batch, batches)?;
    r.activation_gradients = activation_gradients;
    r.backward = backward;
    r.backward.sort();
    Ok(r)
}

fn measure_compiled(mut g: Graph, path: &Path, data: &Path, batch: usize, batches: usize) -> Result<Ranges> {
    let float = |g: &Graph, v| g.ty(v).dtype.is_some_and(|d: DType| d.is_float());
    let watched: Vec<_> = g
        .value_ids()
        .filter(|&v| matches!(g.value(v).def(), mpc_ir::Def::Node(..) | mpc_ir::Def::Input) && float(&g, v))
        .collect();
    for &v in &watched {
        if !g.is_output(v) {
            g.add_output(v);
        }
    }
    let tensors = crate::run::read_safetensors(data)?;
    let mut feeds: Vec<(String, &HostTensor)> = Vec::new();
    for &v in g.inputs() {
        let name = g.name(v);
        let t = tensors.get(name).ok_or_else(|| {
            let have: Vec<&str> = tensors.keys().map(String::as_str).collect();
            Error::Usage(format!(
                "{}: no tensor `{name}` for the model's input (it has {})",
                data.display(),
                have.join(", ")
            ))
        })?;
        feeds.push((name.to_string(), t));
    }
    let n = feeds.first().map_or(0, |(_, t)| t.shape.first().copied().unwrap_or(0));
    if feeds.iter().any(|(_, t)| t.shape.first() != Some(&n)) || n == 0 {
        return Err(Error::Usage(format!("{}: the inputs need the same, non-zero number of samples", data.display())));
    }
    let mut out = Ranges::default();
    // One lowered program per batch size (the last batch may be short).
    let mut sessions: HashMap<usize, Session<CpuDevice>> = HashMap::new();
    let rerr = |source| Error::Run { path: path.to_owned(), source };
    for start in (0..n).step_by(batch.max(1)).take(batches.max(1)) {
        let rows: Vec<usize> = (start..(start + batch.max(1)).min(n)).collect();
        let inputs: HashMap<String, HostTensor> = feeds
            .iter()
            .map(|(k, t)| {
                let per: usize = t.shape[1..].iter().product();
                let idx: Vec<usize> = rows.iter().flat_map(|&r| r * per..(r + 1) * per).collect();
                let shape = [&[rows.len()], &t.shape[1..]].concat();
                (k.clone(), t.pick(shape, &idx))
            })
            .collect();
        let session = match sessions.entry(rows.len()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let device = CpuDevice::default();
                let program = crate::run::lower_for_inputs(&g, &inputs, device.caps(), path)?;
                e.insert(Session::new(device, program).map_err(rerr)?)
            }
        };
        for (name, t) in session.run(&inputs).map_err(rerr)? {
            if let Some(xs) = t.f32s() {
                out.values.entry(name).or_default().add(&xs);
            } else if t.dtype().is_float() {
                let xs: Vec<f32> = t.f64s().iter().map(|&x| x as f32).collect();
                out.values.entry(name).or_default().add(&xs);
            }
        }
        out.batches += 1;
        out.samples += rows.len();
    }
    Ok(out)
}

/// The ranges calibration uses: read from `ranges_in`, else measured (and saved to
/// `ranges_out`).
pub fn calibrate(g: &Graph, path: &Path, c: &Calibration) -> Result<Ranges> {
    let ranges = match (&c.ranges_in, &c.data) {
        (Some(file), _) => Ranges::read(file)?,
        (None, Some(data)) => measure(g, path, data, c.batch, c.batches)?,
        (None, None) => return Err(Error::Usage("calibration needs --calibrate DATA or --ranges-in FILE".into())),
    };
    if let Some(out) = &c.ranges_out {
        ranges.write(out)?;
    }
    Ok(ranges)
}

/// The text `inspect --ranges` prints: the values at risk under `low`, worst first.
pub fn report(r: &Ranges, low: DType, colours: &HashMap<String, &'static str>) -> String {
    use std::fmt::Write;
    let risky = r.at_risk(low);
    let mut s = format!(
        "ranges: {} float values over {} samples ({} batches); {} at risk in {low}\n",
        r.values.len(),
        r.samples,
        r.batches,
        risky.len()
    );
    for (name, _, why) in &risky {
        let runs = colours.get(*name).copied().unwrap_or("-");
        writeln!(s, "  `{name}` (computed {runs} by the policy): {why}").ok();
    }
    let non_finite: Vec<&String> = r.values.iter().filter(|(_, v)| v.nan + v.inf > 0).map(|(k, _)| k).collect();
    if !non_finite.is_empty() {
        writeln!(
            s,
            "  not finite in FP32 already: {}",
            non_finite.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
        )
        .ok();
    }
    s
}

/// Draws the histogram as the paper's Figure 3 does: the share of the activation gradients by
/// log2 |g|, with FP16's subnormal range (2^-24 to 2^-14) and normal range (2^-14 and up)
/// shaded, and what lies left of 2^-24 lost. Written to `path` as SVG, atomically.
pub fn plot(h: &GradientHistogram, title: &str, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let nz = h.nonzero().max(1) as f64;
    let first = h.log2_hist.iter().position(|&c| c > 0).map_or(-30, |i| i as i32 + HIST_MIN).min(-26);
    let last = h.log2_hist.iter().rposition(|&c| c > 0).map_or(0, |i| i as i32 + HIST_MIN).max(-10);
    let top = h.log2_hist.iter().map(|&c| 100.0 * c as f64 / nz).fold(1.0, f64::max) * 1.1;
    let mut svg = String::new();
    let draw = |svg: &mut String| -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::with_string(svg, (900, 450)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(first as f64..(last + 1) as f64, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("log2 |activation gradient| (loss scale 1)")
            .y_desc("% of non-zero values")
            .x_label_formatter(&|x| format!("2^{}", *x as i32))
            .disable_x_mesh()
            .draw()?;
        let shade = |lo: f64, hi: f64, c: RGBColor| Rectangle::new([(lo, 0.0), (hi, top)], c.mix(0.15).filled());
        chart.draw_series([shade(-24.0, -14.0, BLUE), shade(-14.0, (last + 1) as f64, GREEN)])?;
        chart
            .draw_series([shade(first as f64, -24.0, RED)])?
            .label("lost in FP16 (below 2^-24)")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], RED.mix(0.3).filled()));
        chart.draw_series(h.log2_hist.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| {
            let e = (i as i32 + HIST_MIN) as f64;
            Rectangle::new([(e + 0.1, 0.0), (e + 0.9, 100.0 * c as f64 / nz)], BLACK.mix(0.7).filled())
        }))?;
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| Error::Usage(format!("{}: cannot draw: {e}", path.display())))?;
    crate::write_atomic(path, svg.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The thresholds agree with the `half` crate's conversions around every edge.
    #[test]
    fn flush_and_overflow_match_the_conversions() {
        let mut xs: Vec<f32> = Vec::new();
        for edge in
            [2f32.powi(-25), 2f32.powi(-24), 65504.0, 65520.0, f32::from_bits(0x8000), f32::from_bits(0x7F7F_8000)]
        {
            let b = edge.to_bits();
            for d in 0..4u32 {
                xs.extend([f32::from_bits(b - d), f32::from_bits(b + d)]);
            }
        }
        xs.extend([1.0, -3.0e-9, 7.0e4, f32::MAX, f32::from_bits(1), -f32::from_bits(0x7F7F_7FFF)]);
        for &x in &xs {
            let mut r = ValueRange::default();
            r.add(&[x]);
            let (h, b) = (f16::from_f32(x), bf16::from_f32(x));
            assert_eq!(r.f16_flushed == 1, h.to_f32() == 0.0, "f16 flush of {x:e}");
            assert_eq!(r.f16_overflow == 1, h.is_infinite(), "f16 overflow of {x:e}");
            assert_eq!(r.bf16_flushed == 1, b.to_f32() == 0.0, "bf16 flush of {x:e}");
            assert_eq!(r.bf16_overflow == 1, b.is_infinite(), "bf16 overflow of {x:e}");
            let bucket = r.log2_hist.iter().position(|&c| c == 1).unwrap() as i32 + HIST_MIN;
            assert_eq!(bucket, (f64::from(x.abs()).log2().floor() as i32).clamp(HIST_MIN, HIST_MAX), "log2 of {x:e}");
        }
    }

    #[test]
    fn harm_names_the_measurement() {
        let mut r = ValueRange::default();
        r.add(&[1e5, 1.0, 2.0]);
        assert!(r.harm(DType::F16).unwrap().contains("max |x| 1.000e5 > 65504"), "{:?}", r.harm(DType::F16));
        assert_eq!(r.harm(DType::BF16), None);
        let mut r = ValueRange::default();
        r.add(&[1e-9; 99]);
        r.add(&[1.0]);
        assert!(r.harm(DType::F16).unwrap().starts_with("99.0% of the non-zeros"));
        let mut r = ValueRange::default();
        let mut xs = vec![1.0f32; 99];
        xs.push(1e-9);
        r.add(&xs);
        assert_eq!(r.harm(DType::F16), None, "1 flushed of 100 is not above 1%");
    }
}
