//! Colouring, in the order of TF grappler's auto_mixed_precision:
//!
//! 1. seed: `Low` ops are low;
//! 2. F32 spreads forward from `F32` ops through `Follow` ops, and through `Clear` ops only where
//!    the clear path leads on to a `Follow` or `F32` op (a clear chain that ends in a low op stays
//!    free to be low);
//! 3. `Follow` and `Clear` ops on a path from one low op to another become low;
//! 4. low spreads both ways through `Clear` ops not yet coloured.
//!
//! Everything else stays F32. The graph seen here has an edge for every float tensor that flows
//! from one coloured node's output to another's `T` input; nothing else carries colour.

use mpc_ir::NodeId;

use super::table::Class;

/// The precision a node gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Colour {
    Low,
    F32,
}

/// Why a node got its colour: the rule, and the neighbour that passed it on where there is one.
#[derive(Clone, Debug, PartialEq)]
pub enum Reason {
    /// In the low list.
    LowList,
    /// In the F32 list.
    F32List,
    /// Pinned to F32 by the user.
    Pinned,
    /// Reads a constant the low dtype cannot hold.
    UnsafeConstant(String),
    /// Calibration measured its output breaking in the low dtype: how.
    Measured(String),
    /// F32 spread forward from this node (step 2).
    AfterF32(NodeId),
    /// On a path between low ops, reached backwards from this low node (step 3).
    BetweenLow(NodeId),
    /// A clear op next to this low node (step 4).
    ClearNextToLow(NodeId),
    /// A follow op not between two low ops.
    FollowDefault,
    /// A clear op with no low neighbour.
    ClearDefault,
    /// The `fp16` policy: every op low.
    Everything,
}

/// The graph the colouring works on, indexed by node index.
pub(crate) struct ColourGraph {
    pub class: Vec<Option<Class>>,
    pub succ: Adjacency,
    pub pred: Adjacency,
    /// Nodes forced to F32 before colouring (pins, unsafe constants), with the reason.
    pub forced: Vec<Option<Reason>>,
}

/// Every node's neighbours in one array (compressed rows): a graph of a million nodes is two
/// arrays, not a million small lists.
pub(crate) struct Adjacency {
    /// Node `i`'s neighbours are `list[start[i]..start[i + 1]]`.
    start: Vec<u32>,
    list: Vec<u32>,
}

impl Adjacency {
    /// The lists of `n` nodes from `(from, to)` edges, each list in the edges' order.
    pub fn new(n: usize, edges: &[(u32, u32)]) -> Adjacency {
        let mut start = vec![0u32; n + 1];
        for &(from, _) in edges {
            start[from as usize + 1] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut next = start.clone();
        let mut list = vec![0u32; edges.len()];
        for &(from, to) in edges {
            list[next[from as usize] as usize] = to;
            next[from as usize] += 1;
        }
        Adjacency { start, list }
    }

    pub fn of(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.list[self.start[i] as usize..self.start[i + 1] as usize].iter().map(|&j| j as usize)
    }
}

fn id(i: usize) -> NodeId {
    NodeId::from_index(i)
}

/// Colours every node that has a class; `None` for the others.
pub(crate) fn colour(cg: &ColourGraph, everything_low: bool) -> Vec<Option<(Colour, Reason)>> {
    let n = cg.class.len();
    let mut out: Vec<Option<(Colour, Reason)>> = vec![None; n];
    let is = |i: usize, c: Class| cg.class[i] == Some(c);
    for (i, slot) in out.iter_mut().enumerate() {
        let Some(class) = cg.class[i] else { continue };
        *slot = match &cg.forced[i] {
            Some(r) => Some((Colour::F32, r.clone())),
            None if everything_low => Some((Colour::Low, Reason::Everything)),
            None if class == Class::Low => Some((Colour::Low, Reason::LowList)),
            None if class == Class::F32 => Some((Colour::F32, Reason::F32List)),
            None => None,
        };
    }
    if everything_low {
        return out;
    }
    let low = |out: &[Option<(Colour, Reason)>], i: usize| matches!(out[i], Some((Colour::Low, _)));
    let f32_ = |out: &[Option<(Colour, Reason)>], i: usize| matches!(out[i], Some((Colour::F32, _)));

    // Step 2. Clear nodes from which a follow or F32 node is reachable through clear nodes.
    let mut upstream = vec![false; n];
    let mut stack: Vec<usize> = (0..n).filter(|&i| is(i, Class::Follow) || f32_(&out, i)).collect();
    while let Some(i) = stack.pop() {
        for p in cg.pred.of(i) {
            if is(p, Class::Clear) && !upstream[p] {
                upstream[p] = true;
                stack.push(p);
            }
        }
    }
    let mut stack: Vec<usize> = (0..n).filter(|&i| f32_(&out, i)).collect();
    while let Some(i) = stack.pop() {
        for s in cg.succ.of(i) {
            let enter = out[s].is_none() && (is(s, Class::Follow) || (is(s, Class::Clear) && upstream[s]));
            if enter {
                out[s] = Some((Colour::F32, Reason::AfterF32(id(i))));
                stack.push(s);
            }
        }
    }

    // Step 3. Follow/clear nodes downstream of a low node...
    let free =
        |out: &[Option<(Colour, Reason)>], i: usize| out[i].is_none() && (is(i, Class::Follow) || is(i, Class::Clear));
    let mut downstream = vec![false; n];
    let mut stack: Vec<usize> = (0..n).filter(|&i| low(&out, i)).collect();
    while let Some(i) = stack.pop() {
        for s in cg.succ.of(i) {
            if free(&out, s) && !downstream[s] {
                downstream[s] = true;
                stack.push(s);
            }
        }
    }
    // ...that are also upstream of one become low.
    let mut stack: Vec<(usize, usize)> = (0..n).filter(|&i| low(&out, i)).map(|i| (i, i)).collect();
    while let Some((i, root)) = stack.pop() {
        for p in cg.pred.of(i) {
            if free(&out, p) && downstream[p] {
                out[p] = Some((Colour::Low, Reason::BetweenLow(id(root))));
                stack.push((p, root));
            }
        }
    }

    // Step 4. Low spreads both ways through clear nodes.
    let mut stack: Vec<(usize, usize)> = (0..n).filter(|&i| low(&out, i)).map(|i| (i, i)).collect();
    while let Some((i, root)) = stack.pop() {
        for j in cg.succ.of(i).chain(cg.pred.of(i)) {
            if out[j].is_none() && is(j, Class::Clear) {
                out[j] = Some((Colour::Low, Reason::ClearNextToLow(id(root))));
                stack.push((j, root));
            }
        }
    }

    for (slot, class) in out.iter_mut().zip(&cg.class) {
        if slot.is_none() {
            *slot = match class {
                Some(Class::Follow) => Some((Colour::F32, Reason::FollowDefault)),
                Some(Class::Clear) => Some((Colour::F32, Reason::ClearDefault)),
                _ => None,
            };
        }
    }
    out
}
