//! Cast cleanup: removes casts that change nothing, folds chains that are exact, merges duplicates.
//!
//! - `Cast(x → dtype of x)` is removed.
//! - `Cast(Cast(x: A → B) → C)` reads `x` directly when A → B is exact (B holds every value of A):
//!   a low → high → low round trip becomes an identity and goes, and an existing `bool → f32` cast
//!   that now feeds a `f32 → f16` cast becomes `bool → f16`. A high → low → high pair is never
//!   folded: it rounds, and removing it would change values.
//! - Two casts of the same value to the same dtype become one.
//!
//! Values referred to by name (graph outputs, subgraph reads) are never removed or renamed. Runs
//! only under a precision policy.

use std::collections::HashMap;

use mpc_ir::{DType, Graph, Op, ValueId};

use crate::{Changed, Context, Pass, Result};

pub struct CastCleanup;

/// Whether converting A → B keeps every value of A exactly.
pub fn exact(a: DType, b: DType) -> bool {
    use DType::*;
    a == b
        || a == Bool
        || matches!(
            (a, b),
            (U8, I16 | U16 | I32 | U32 | I64 | U64 | F16 | BF16 | F32 | F64)
                | (I8, I16 | I32 | I64 | F16 | BF16 | F32 | F64)
                | (U16, I32 | U32 | I64 | U64 | F32 | F64)
                | (I16, I32 | I64 | F32 | F64)
                | (U32, I64 | U64 | F64)
                | (I32, I64 | F64)
                | (F16 | BF16, F32 | F64)
                | (F32, F64)
        )
}

impl Pass for CastCleanup {
    fn name(&self) -> &'static str {
        "cast-cleanup"
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        if cx.policy.is_none() {
            return Ok(Changed::No);
        }
        let mut changed = Changed::No;
        while cleanup_once(g)? {
            changed = Changed::Yes;
        }
        Ok(changed)
    }
}

fn cleanup_once(g: &mut Graph) -> Result<bool> {
    let mut changed = false;
    let mut seen: HashMap<(ValueId, DType), ValueId> = HashMap::new();
    for n in g.topo_order()? {
        let Op::Cast(a) = &g.node(n).op else { continue };
        let to = a.to;
        let (Some(x), out) = (g.node(n).input(0), g.node(n).outputs()[0]) else { continue };
        let keep_name = g.name_is_referenced(out);
        // Fold an exact first step of a chain.
        if let Some((p, 0)) = g.value(x).producer() {
            if let Op::Cast(first) = &g.node(p).op {
                let src = g.node(p).input(0);
                let a_dt = src.and_then(|s| g.ty(s).dtype);
                if let (Some(src), Some(a_dt)) = (src, a_dt) {
                    if exact(a_dt, first.to) {
                        g.set_input(n, 0, Some(src));
                        if g.value(x).uses().is_empty() && !g.name_is_referenced(x) {
                            g.remove_node(p);
                            seen.retain(|_, v| *v != x);
                        }
                        changed = true;
                        continue;
                    }
                }
            }
        }
        // Identity.
        if g.ty(x).dtype == Some(to) && !keep_name {
            g.replace_uses(out, x);
            g.remove_node(n);
            changed = true;
            continue;
        }
        // Duplicate.
        match seen.get(&(x, to)) {
            Some(&first) if !keep_name => {
                g.replace_uses(out, first);
                g.remove_node(n);
                changed = true;
            }
            Some(_) => {}
            None => {
                seen.insert((x, to), out);
            }
        }
    }
    Ok(changed)
}
