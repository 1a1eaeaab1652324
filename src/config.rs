//! Policy files (`--config policy.toml`).
//!
//! ```toml
//! policy = "mixed"            # base policy when --policy is not given
//! low_dtype = "bf16"          # f16 or bf16
//! io_types = "keep"           # keep, or low: graph inputs and outputs in the low dtype
//! allow = ["Einsum"]          # ops that run low
//! deny = ["Sigmoid"]          # ops that stay FP32
//! follow = ["Relu"]           # ops that follow their neighbours
//! clear = []                  # ops that are data movement
//! pin_fp32 = ["/attn/Softmax"]  # node names that stay FP32
//!
//! [train]                     # compile --train and train; a flag given on the command line wins
//! loss = "cross-entropy"      # cross-entropy[:axis=-1,ignore-index=-100], mse or output:NAME
//! labels = "labels"
//! optimizer = "adamw"         # sgd, momentum, adam or adamw
//! lr = 3e-4
//! weight_decay = 0.01
//! no_decay = ["biases", "norms"]  # or name patterns: "*.bias", "ln_*"
//! momentum = 0.9              # the momentum optimizer's
//! beta1 = 0.9                 # Adam's
//! beta2 = 0.999
//! epsilon = 1e-8
//! clip_norm = 1.0
//! accumulate = 4             # micro-batches per update (gradient accumulation)
//! loss_scale = "dynamic"      # dynamic, auto, static:S or none (default: dynamic for mixed, else none)
//! init_scale = 65536.0        # dynamic loss scaling: the start,
//! growth_factor = 2.0         # ×2 after growth_interval finite steps,
//! growth_interval = 2000
//! backoff_factor = 0.5        # ×½ on a non-finite step,
//! min_scale = 1.0             # within [min_scale, max_scale]
//! max_scale = 16777216.0
//! freeze = ["embed.weight"]
//! tie = false                 # keep exported copies of one weight (a tied LM head) apart
//! weight_copies = false       # cast the masters every step, not keep low copies the update writes
//! seed = 7                    # dropout masks (and train's sample order)
//! ```
//!
//! Unknown keys, unknown op names and unknown node names are errors that name them.

use serde::Deserialize;

use mpc_ir::ops::{LrKind, LrScheduleAttrs};
use mpc_passes::precision::{Class, Policy};
use mpc_passes::train::{CrossEntropy, Loss, LossScale, NoDecay, Optimizer, Schedule, TrainOptions};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    pub policy: Option<String>,
    pub low_dtype: Option<String>,
    pub io_types: Option<String>,
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
    #[serde(default)]
    pub follow: Vec<String>,
    #[serde(default)]
    pub clear: Vec<String>,
    #[serde(default)]
    pub pin_fp32: Vec<String>,
    #[serde(default)]
    pub train: TrainFile,
}

impl PolicyFile {
    pub fn parse(text: &str) -> Result<PolicyFile, String> {
        // "TOML parse error at line L, column C: message", without the multi-line excerpt.
        toml::from_str(text).map_err(|e| {
            let at = e.to_string().lines().next().unwrap_or("TOML parse error").to_string();
            format!("{at}: {}", e.message())
        })
    }

    /// Whether the file changes the precision policy (beyond naming it).
    pub fn edits_policy(&self) -> bool {
        self.low_dtype.is_some()
            || self.io_types.is_some()
            || [&self.allow, &self.deny, &self.follow, &self.clear, &self.pin_fp32].iter().any(|l| !l.is_empty())
    }

    /// Applies the file's edits to `policy`.
    pub fn apply(&self, policy: &mut Policy) -> Result<(), String> {
        match self.low_dtype.as_deref() {
            None => {}
            Some("f16") => policy.low = mpc_ir::DType::F16,
            Some("bf16") => policy.low = mpc_ir::DType::BF16,
            Some(d) => return Err(format!("low_dtype `{d}`: expected f16 or bf16")),
        }
        match self.io_types.as_deref() {
            None => {}
            Some("keep") => policy.io_low = false,
            Some("low") => policy.io_low = true,
            Some(d) => return Err(format!("io_types `{d}`: expected keep or low")),
        }
        for (ops, class) in [
            (&self.allow, Class::Low),
            (&self.deny, Class::F32),
            (&self.follow, Class::Follow),
            (&self.clear, Class::Clear),
        ] {
            for op in ops {
                policy.set_class(op, class)?;
            }
        }
        policy.pin_fp32.extend(self.pin_fp32.iter().cloned());
        Ok(())
    }
}

/// The training options, as the `[train]` table or the command line gives them: `None` where
/// unset, so that a flag overrides the file and the file the defaults.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    pub loss: Option<String>,
    pub labels: Option<String>,
    pub optimizer: Option<String>,
    pub lr: Option<f32>,
    /// constant, linear, cosine, step[:size=N,gamma=G] or one-cycle[:div=D].
    pub schedule: Option<String>,
    /// Updates of warmup, or below 1 a share of the run.
    pub warmup: Option<f64>,
    pub lr_min: Option<f32>,
    pub total_steps: Option<u64>,
    pub weight_decay: Option<f32>,
    pub momentum: Option<f32>,
    pub beta1: Option<f32>,
    pub beta2: Option<f32>,
    pub epsilon: Option<f32>,
    pub clip_norm: Option<f32>,
    pub loss_scale: Option<String>,
    pub init_scale: Option<f32>,
    pub growth_factor: Option<f32>,
    pub growth_interval: Option<i64>,
    pub backoff_factor: Option<f32>,
    pub min_scale: Option<f32>,
    pub max_scale: Option<f32>,
    #[serde(default)]
    pub freeze: Vec<String>,
    pub seed: Option<u64>,
    /// Train copies and transposes of one weight as one parameter (default true).
    pub tie: Option<bool>,
    /// Keep each master's low-precision copy as state the update writes (default true).
    pub weight_copies: Option<bool>,
    /// Parameters trained without weight decay: `biases`, `norms`, or name patterns (`*.bias`).
    #[serde(default)]
    pub no_decay: Vec<String>,
    /// Micro-batches per update (gradient accumulation; default 1).
    pub accumulate: Option<u32>,
}

impl TrainFile {
    /// These settings over `base`'s: each one set here wins; frozen names add up.
    pub fn over(&self, base: &TrainFile) -> TrainFile {
        macro_rules! pick {
            ($($f:ident),*) => { TrainFile { $($f: self.$f.clone().or_else(|| base.$f.clone()),)* freeze: [base.freeze.clone(), self.freeze.clone()].concat(), no_decay: [base.no_decay.clone(), self.no_decay.clone()].concat() } };
        }
        pick!(
            loss,
            labels,
            optimizer,
            lr,
            schedule,
            warmup,
            lr_min,
            total_steps,
            weight_decay,
            momentum,
            beta1,
            beta2,
            epsilon,
            clip_norm,
            loss_scale,
            init_scale,
            growth_factor,
            growth_interval,
            backoff_factor,
            min_scale,
            max_scale,
            seed,
            tie,
            weight_copies,
            accumulate
        )
    }

    /// The training options, and the loss scaling when one is asked for (`None`: the policy's
    /// default). Messages name the setting (`lr`, `loss_scale`, ...).
    pub fn resolve(&self) -> Result<(TrainOptions, Option<LossScale>), String> {
        let d = TrainOptions::default();
        let loss = match self.loss.as_deref() {
            None => Loss::CrossEntropy(CrossEntropy::default()),
            Some("mse") => Loss::Mse,
            Some(l) => match (l.strip_prefix("output:"), l.strip_prefix("cross-entropy")) {
                (Some(name), _) if !name.is_empty() => Loss::Output(name.to_string()),
                (_, Some(rest)) => Loss::CrossEntropy(cross_entropy(rest).map_err(|e| format!("loss `{l}`: {e}"))?),
                _ => {
                    return Err(format!(
                        "loss `{l}`: expected cross-entropy[:axis=N,ignore-index=N|none], mse or output:NAME"
                    ))
                }
            },
        };
        let optimizer = match self.optimizer.as_deref() {
            Some("sgd") => Optimizer::Sgd,
            Some("momentum") => Optimizer::Momentum,
            None | Some("adam") => Optimizer::Adam,
            Some("adamw") => Optimizer::AdamW,
            Some(o) => return Err(format!("optimizer `{o}`: expected sgd, momentum, adam or adamw")),
        };
        let positive = |what: &str, v: Option<f32>, default: f32| match v {
            Some(x) if !(x > 0.0 && x.is_finite()) => Err(format!("{what} {x}: expected a positive number")),
            v => Ok(v.unwrap_or(default)),
        };
        let share = |what: &str, v: Option<f32>, default: f32| match v {
            Some(x) if !(0.0..1.0).contains(&x) => Err(format!("{what} {x}: expected a number in [0, 1)")),
            v => Ok(v.unwrap_or(default)),
        };
        let mut dynamic = d.dynamic_scale.clone();
        dynamic.init = positive("init_scale", self.init_scale, dynamic.init)?;
        let a = &mut dynamic.attrs;
        a.growth_factor = positive("growth_factor", self.growth_factor, a.growth_factor)?;
        a.backoff_factor = positive("backoff_factor", self.backoff_factor, a.backoff_factor)?;
        a.min_scale = positive("min_scale", self.min_scale, a.min_scale)?;
        a.max_scale = positive("max_scale", self.max_scale, a.max_scale)?;
        a.growth_interval = match self.growth_interval {
            Some(n) if n < 1 => return Err(format!("growth_interval {n}: expected a positive count")),
            n => n.unwrap_or(a.growth_interval),
        };
        if a.min_scale > a.max_scale {
            return Err(format!("min_scale {} is above max_scale {}", a.min_scale, a.max_scale));
        }
        let scale = match self.loss_scale.as_deref() {
            None => None,
            Some("dynamic") => Some(dynamic.loss_scale()),
            Some("none") => Some(LossScale::None),
            Some("auto") => Some(LossScale::Auto { attrs: dynamic.attrs.clone() }),
            Some(s) => match s.strip_prefix("static:").and_then(|v| v.parse::<f32>().ok()) {
                Some(v) if v > 0.0 && v.is_finite() => Some(LossScale::Static(v)),
                _ => return Err(format!("loss_scale `{s}`: expected dynamic, auto, static:S or none")),
            },
        };
        let opts = TrainOptions {
            loss,
            labels: self.labels.clone().unwrap_or(d.labels),
            optimizer,
            lr: positive("lr", self.lr, d.lr)?,
            weight_decay: match self.weight_decay {
                Some(w) if !(w >= 0.0 && w.is_finite()) => {
                    return Err(format!("weight_decay {w}: expected a number >= 0"))
                }
                w => w.unwrap_or(d.weight_decay),
            },
            momentum: share("momentum", self.momentum, d.momentum)?,
            beta1: share("beta1", self.beta1, d.beta1)?,
            beta2: share("beta2", self.beta2, d.beta2)?,
            epsilon: positive("epsilon", self.epsilon, d.epsilon)?,
            clip_norm: self.clip_norm.map(|c| positive("clip_norm", Some(c), c)).transpose()?,
            freeze: self.freeze.iter().cloned().collect(),
            seed: self.seed.unwrap_or(d.seed),
            tie: self.tie.unwrap_or(d.tie),
            weight_copies: self.weight_copies.unwrap_or(d.weight_copies),
            no_decay: self.no_decay.iter().flat_map(|i| i.split(',')).map(|i| NoDecay::parse(i.trim())).collect(),
            dynamic_scale: dynamic,
            accumulate: match self.accumulate {
                Some(0) => return Err("accumulate 0: expected a positive count of micro-batches".into()),
                a => a.unwrap_or(d.accumulate),
            },
            ..d
        };
        let schedule = self.schedule(opts.lr)?;
        Ok((TrainOptions { schedule, ..opts }, scale))
    }
}

impl TrainFile {
    /// The learning-rate schedule `schedule`, `warmup`, `lr_min` and `total_steps` ask for
    /// (`None`: a constant rate without warmup); `lr` is the peak rate.
    fn schedule(&self, lr: f32) -> Result<Option<Schedule>, String> {
        if self.schedule.is_none() && self.warmup.is_none_or(|w| w == 0.0) {
            return Ok(None);
        }
        let text = self.schedule.as_deref().unwrap_or("constant");
        let (name, rest) = text.split_once(':').map_or((text, None), |(n, r)| (n, Some(r)));
        let mut a = LrScheduleAttrs { total: self.total_steps.unwrap_or(0) as i64, ..Default::default() };
        a.kind = match name {
            "constant" => LrKind::Constant,
            "linear" => LrKind::Linear,
            "cosine" => LrKind::Cosine,
            "step" => LrKind::Step,
            "one-cycle" => LrKind::OneCycle,
            _ => {
                return Err(format!(
                    "schedule `{text}`: expected constant, linear, cosine, step[:size=N,gamma=G] or one-cycle[:div=D]"
                ))
            }
        };
        let mut div = 25.0f32;
        for item in rest.into_iter().flat_map(|r| r.split(',')) {
            let bad = || {
                format!(
                    "schedule `{text}`: `{item}` is not a setting of {name} (step: size=N, gamma=G; one-cycle: div=D)"
                )
            };
            let (key, value) = item.split_once('=').ok_or_else(bad)?;
            let number = value.trim().parse::<f64>().ok().filter(|x| *x > 0.0 && x.is_finite());
            match (a.kind, key.trim(), number) {
                (LrKind::Step, "size", Some(n)) if n.fract() == 0.0 => a.step_size = n as i64,
                (LrKind::Step, "gamma", Some(g)) => a.gamma = g as f32,
                (LrKind::OneCycle, "div", Some(d)) => div = d as f32,
                _ => return Err(bad()),
            }
        }
        let warmup_share = match self.warmup {
            Some(w) if !(w >= 0.0 && w.is_finite()) => {
                return Err(format!("warmup {w}: expected a count of updates or a share below 1"))
            }
            Some(w) if w < 1.0 => Some(w),
            Some(w) if w.fract() != 0.0 => return Err(format!("warmup {w}: a count of updates is a whole number")),
            Some(w) => {
                a.warmup = w as i64;
                None
            }
            None => None,
        };
        a.start_ratio = 1.0 / div;
        a.min_ratio = match self.lr_min {
            Some(m) if !(m >= 0.0 && m <= lr) => return Err(format!("lr_min {m}: expected a rate in [0, lr = {lr}]")),
            Some(m) => m / lr,
            None if a.kind == LrKind::OneCycle => a.start_ratio / 1e4,
            None => 0.0,
        };
        if a.kind == LrKind::OneCycle && a.warmup == 0 && warmup_share.is_none() {
            // OneCycleLR's default: the rise is 30% of the run.
            return Ok(Some(Schedule { attrs: a, warmup_share: Some(0.3) }));
        }
        Ok(Some(Schedule { attrs: a, warmup_share }))
    }
}

/// The settings after `cross-entropy`: nothing, or `:` and comma-separated `axis=N`,
/// `ignore-index=N` or `ignore-index=none`.
fn cross_entropy(rest: &str) -> Result<CrossEntropy, String> {
    let mut ce = CrossEntropy::default();
    let Some(list) = rest.strip_prefix(':') else {
        return if rest.is_empty() { Ok(ce) } else { Err("expected `:` after cross-entropy".into()) };
    };
    for item in list.split(',') {
        let (key, value) = item.split_once('=').ok_or_else(|| format!("`{item}` is not KEY=VALUE"))?;
        let int = || value.trim().parse::<i64>().map_err(|_| format!("`{key}` is `{value}`, not an integer"));
        match key.trim() {
            "axis" => ce.axis = int()?,
            "ignore-index" if value.trim() == "none" => ce.ignore_index = None,
            "ignore-index" => ce.ignore_index = Some(int()?),
            k => return Err(format!("unknown setting `{k}` (axis, ignore-index)")),
        }
    }
    Ok(ce)
}
