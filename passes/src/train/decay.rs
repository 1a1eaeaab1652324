//! Parameter groups for weight decay: which parameters `--no-decay` exempts, as Hugging Face's
//! Trainer (no decay on biases and LayerNorm weights) and timm's `param_groups_weight_decay`
//! (none on 1-D parameters) do.

use std::collections::HashSet;

use mpc_ir::{Graph, Op, ValueId};

use crate::{PassError, Result};

/// What `--no-decay` names, one item each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoDecay {
    /// A bias: a 1-D parameter read as the bias of Conv, ConvTranspose or Gemm, or whose name
    /// contains `bias`.
    Biases,
    /// A normalisation's scale or bias (BatchNormalization, LayerNormalization,
    /// InstanceNormalization, GroupNormalization, RMSNormalization, SkipLayerNormalization), and
    /// a 1-D parameter whose name contains `norm` (a normalisation the exporter decomposed).
    Norms,
    /// Parameters whose name matches this pattern (`*` any run of characters).
    Named(String),
}

impl NoDecay {
    /// `biases`, `norms`, or a name pattern.
    pub fn parse(item: &str) -> NoDecay {
        match item {
            "biases" => NoDecay::Biases,
            "norms" => NoDecay::Norms,
            p => NoDecay::Named(p.to_string()),
        }
    }
}

/// The parameters of `params` that `items` exempt from weight decay. A name pattern that matches
/// no parameter is an error (a misspelt name must not train with decay silently).
pub fn exempt(g: &Graph, params: &[ValueId], items: &[NoDecay]) -> Result<HashSet<ValueId>> {
    let mut out = HashSet::new();
    for item in items {
        let hits: Vec<ValueId> = params.iter().copied().filter(|&p| names(g, p, item)).collect();
        if let (NoDecay::Named(pat), true) = (item, hits.is_empty()) {
            return Err(PassError::Usage(format!("no_decay `{pat}`: no trained parameter's name matches it")));
        }
        out.extend(hits);
    }
    Ok(out)
}

fn names(g: &Graph, p: ValueId, item: &NoDecay) -> bool {
    let name = g.name(p).to_ascii_lowercase();
    let one_d = g.ty(p).shape.as_ref().is_some_and(|s| s.dims().len() == 1);
    match item {
        NoDecay::Biases => {
            one_d && (name.contains("bias") || readers(g, p).iter().any(|&(op, slot)| is_bias(op, slot)))
        }
        NoDecay::Norms => {
            (one_d && name.contains("norm")) || readers(g, p).iter().any(|&(op, slot)| slot > 0 && is_norm(op))
        }
        NoDecay::Named(pat) => matches(pat, g.name(p)),
    }
}

/// The ops (and input slots) that read `v`, looking through Cast and Identity.
fn readers(g: &Graph, v: ValueId) -> Vec<(&Op, usize)> {
    let mut out = Vec::new();
    for u in g.value(v).uses() {
        let node = g.node(u.node);
        match node.op {
            Op::Cast(_) | Op::Identity => node.outputs().iter().for_each(|&o| out.extend(readers(g, o))),
            _ => out.push((&node.op, u.slot)),
        }
    }
    out
}

fn is_bias(op: &Op, slot: usize) -> bool {
    slot == 2 && matches!(op, Op::Conv(_) | Op::ConvTranspose(_) | Op::Gemm(_))
}

fn is_norm(op: &Op) -> bool {
    matches!(
        op,
        Op::BatchNormalization(_)
            | Op::LayerNormalization(_)
            | Op::InstanceNormalization(_)
            | Op::GroupNormalization(_)
    ) || matches!(op.op_type(), "RMSNormalization" | "SkipLayerNormalization" | "SimplifiedLayerNormalization")
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
fn matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return name == pattern;
    }
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_match_as_globs() {
        assert!(matches("*.bias", "fc1.bias"));
        assert!(matches("fc1.*", "fc1.weight"));
        assert!(matches("*ln*w*", "h.0.ln_1.weight"));
        assert!(matches("fc1.bias", "fc1.bias"));
        assert!(!matches("fc1.bias", "fc1.bias2"));
        assert!(!matches("*.bias", "fc1.weight"));
        assert!(!matches("a*a", "a"));
    }
}
