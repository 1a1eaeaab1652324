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
//! ```
//!
//! Unknown keys, unknown op names and unknown node names are errors that name them.

use serde::Deserialize;

use mpc_passes::precision::{Class, Policy};

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
}

impl PolicyFile {
    pub fn parse(text: &str) -> Result<PolicyFile, String> {
        // "TOML parse error at line L, column C: message", without the multi-line excerpt.
        toml::from_str(text).map_err(|e| {
            let at = e.to_string().lines().next().unwrap_or("TOML parse error").to_string();
            format!("{at}: {}", e.message())
        })
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
