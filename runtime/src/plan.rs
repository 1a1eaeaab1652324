//! The arena's placement: buffers with lifetimes packed into one region.
//!
//! Lowering gives every buffer of the activation arena its lifetime in launch steps (an
//! element-wise output that takes over an input dying with it extends that input's buffer); this
//! module places them, each at the lowest offset free over its whole lifetime, trying several
//! orders and keeping the smallest arena. On the fixtures it reaches the most bytes alive at once.

use mpc_ir::Op;

/// Ops whose output may take over the buffer of an input of the same size that dies with them
/// ([`Op::in_place`]).
pub(crate) fn elementwise(op: &Op) -> bool {
    op.in_place()
}

/// Places buffers, each `(size, first step, last step)`, in one arena: each at the lowest offset
/// free over its whole lifetime, in several orders over the same lifetimes, keeping the smallest
/// arena. Largest first and earliest first suit most graphs; for small ones (up to a few
/// thousand buffers) the orders of TFLite's planners are tried too: longest-lived first and
/// largest area (size × lifetime) first. Sizes must already be aligned. Returns each buffer's
/// offset and the arena's size.
pub fn place_buffers(items: &[(u64, usize, usize)]) -> (Vec<u64>, u64) {
    let place = |order: &[usize]| {
        let mut placed: Vec<(u64, u64, usize, usize)> = Vec::with_capacity(order.len()); // offset, size, def, last
        let mut offsets = vec![0u64; items.len()];
        let mut peak = 0u64;
        for &i in order {
            let (size, def, last) = items[i];
            let mut busy: Vec<(u64, u64)> =
                placed.iter().filter(|p| p.2 <= last && def <= p.3).map(|p| (p.0, p.0 + p.1)).collect();
            busy.sort_unstable();
            let mut offset = 0u64;
            for (b, e) in busy {
                if offset + size <= b {
                    break;
                }
                offset = offset.max(e);
            }
            placed.push((offset, size, def, last));
            offsets[i] = offset;
            peak = peak.max(offset + size);
        }
        (offsets, peak)
    };
    type Order = fn(&(u64, usize, usize), &(u64, usize, usize)) -> std::cmp::Ordering;
    let mut orders: Vec<Order> =
        vec![|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)), |a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))];
    if items.len() <= 4_000 {
        orders.push(|a, b| (b.2 - b.1).cmp(&(a.2 - a.1)).then(b.0.cmp(&a.0)).then(a.1.cmp(&b.1)));
        orders.push(|a, b| {
            let area = |x: &(u64, usize, usize)| x.0 * (x.2 - x.1 + 1) as u64;
            area(b).cmp(&area(a)).then(a.1.cmp(&b.1))
        });
    }
    let mut best: Option<(Vec<u64>, u64)> = None;
    // Each order re-sorts the previous one (stable), so ties keep the earlier orders' ranking.
    let mut idx: Vec<usize> = (0..items.len()).collect();
    for order in orders {
        idx.sort_by(|&a, &b| order(&items[a], &items[b]));
        let (offsets, peak) = place(&idx);
        if best.as_ref().is_none_or(|b| peak < b.1) {
            best = Some((offsets, peak));
        }
    }
    best.unwrap_or_default()
}
