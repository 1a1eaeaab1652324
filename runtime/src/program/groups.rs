//! Multi-tensor launches: a step's optimizer updates grouped into one launch
//! ([`Launch::group`]).

use super::*;

/// Runs of consecutive optimizer updates ([`groups()`]) of one op and attribute set, parameter
/// dtype, step, finite flag and unscale, none reading or writing what another writes, each made
/// one multi-tensor launch ([`Launch::group`]) at the run's place. Also each old launch's new
/// index (a group's members all map to it).
pub(super) fn group_updates(launches: Vec<Launch>) -> (Vec<Launch>, Vec<usize>) {
    type Range = (Region, u64, u64);
    let range = |t: &TensorRef| (t.region, t.offset, t.offset + t.bytes());
    let overlap = |a: &Range, b: &Range| a.0 == b.0 && a.1 < b.2 && b.1 < a.2;
    let device = |o: &Operand| match o {
        Operand::Device(t) => Some(t.clone()),
        _ => None,
    };
    let groupable = |l: &Launch| {
        groups(&l.op)
            && l.chain.is_none()
            && l.branches.is_none()
            && l.group.is_empty()
            && l.epilogue.is_none()
            && l.outputs.iter().all(|t| t.numel() > 0)
            && l.inputs.first().and_then(device).is_some()
    };
    // What members of one group share: the op, the parameter dtype and AdamUpdate's operands
    // past the per-parameter ones (inputs 4 to 6 and 8: the step, finite flag, unscale and
    // learning rate).
    const SHARED: [usize; 4] = [4, 5, 6, 8];
    let shared = |l: &Launch| -> (Option<DType>, Vec<Option<TensorRef>>) {
        let dt = l.inputs.first().and_then(device).map(|t| t.dtype);
        (dt, SHARED.iter().map(|&i| l.inputs.get(i).and_then(device)).collect())
    };
    // The ranges a member reads of its own (its shared operands are read by every member and
    // written by none) and writes.
    let own_reads = |l: &Launch| -> Vec<Range> {
        l.inputs
            .iter()
            .enumerate()
            .filter(|(i, _)| !SHARED.contains(i))
            .filter_map(|(_, o)| device(o))
            .map(|t| range(&t))
            .collect()
    };
    let mut out: Vec<Launch> = Vec::with_capacity(launches.len());
    let mut moved = Vec::with_capacity(launches.len());
    let mut run: Vec<Launch> = Vec::new();
    let (mut read, mut written): (Vec<Range>, Vec<Range>) = (Vec::new(), Vec::new());
    let flush = |run: &mut Vec<Launch>, out: &mut Vec<Launch>| match run.len() {
        0 => {}
        1 => out.push(run.pop().expect("one launch")),
        n => {
            let first = &run[0];
            let node = format!("{} updates: {} .. {}", n, first.node, run[n - 1].node);
            let op = first.op.clone();
            out.push(Launch { group: std::mem::take(run), ..Launch::new(node, op, Vec::new(), Vec::new()) });
        }
    };
    for l in launches {
        let (ins, outs): (Vec<Range>, Vec<Range>) = (own_reads(&l), l.outputs.iter().map(range).collect());
        let joins = groupable(&l)
            && run.first().is_some_and(|f| f.op == l.op && shared(f) == shared(&l))
            && ins.iter().all(|r| !written.iter().any(|w| overlap(r, w)))
            && outs.iter().all(|o| !written.iter().any(|w| overlap(o, w)) && !read.iter().any(|r| overlap(o, r)));
        if !joins {
            flush(&mut run, &mut out);
            read.clear();
            written.clear();
        }
        if groupable(&l) {
            read.extend(ins);
            written.extend(outs);
            moved.push(out.len());
            run.push(l);
        } else {
            moved.push(out.len());
            out.push(l);
        }
    }
    flush(&mut run, &mut out);
    (out, moved)
}
