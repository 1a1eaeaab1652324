//! Training data as safetensors shards, memory-mapped and read a batch at a time.
//!
//! A [`Dataset`] is one or more shards whose tensors agree: the same names and, for each, the same
//! dtype (the first dim is the sample; shards may hold different counts). Samples are numbered
//! across the shards in order. Shards whose per-sample shapes are the same form a bucket (one
//! sequence length, one image size): a batch takes its samples from one bucket, and a model with
//! a symbolic sequence axis trains at each bucket's length. A batch copies its rows out of the maps; the
//! pages it read are handed back to the kernel every [`RELEASE_EVERY`] bytes, so the process's
//! resident memory does not grow with the dataset, however large.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mpc_ir::DType;
use mpc_runtime::HostTensor;

use crate::{Error, Result};

/// Bytes of mapped pages read between two releases.
const RELEASE_EVERY: u64 = 64 << 20;

/// The bytes a read of one row may make resident: its pages, and those the kernel maps around a
/// fault (64 KiB on Linux by default) where it does so in spite of the maps' random-access advice.
const FAULT_AROUND: u64 = 64 << 10;

/// A tensor of every shard: its dtype and the shape of one sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub dtype: DType,
    pub sample: Vec<usize>,
}

impl Column {
    fn row_bytes(&self) -> usize {
        self.sample.iter().product::<usize>() * self.dtype.size()
    }
}

struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    columns: BTreeMap<String, Column>,
    /// The bucket: the first shard's number among those with these columns.
    bucket: usize,
    /// Where each tensor's bytes start in the map.
    starts: HashMap<String, usize>,
    samples: usize,
}

/// Samples of one per-sample shape ([`Dataset::buckets`]).
pub struct Bucket<'a> {
    /// Its first shard.
    pub path: &'a Path,
    /// Its first sample, where it has one.
    pub first: Option<usize>,
    /// Its samples among those counted.
    pub samples: usize,
}

/// One or more shards: see the [module](self).
pub struct Dataset {
    shards: Vec<Shard>,
    /// The number of the first sample of each shard.
    firsts: Vec<usize>,
    samples: usize,
    /// Bytes of pages read since the last release.
    touched: Cell<u64>,
}

impl Dataset {
    /// Opens the shards `paths` (each a file or a pattern with `*` and `?` in its file name,
    /// which names the matching files in sorted order) and checks that they agree.
    pub fn open(paths: &[PathBuf]) -> Result<Dataset> {
        let mut files = Vec::new();
        for p in paths {
            files.extend(expand(p)?);
        }
        if files.is_empty() {
            return Err(Error::Usage("no data: give --data FILE.safetensors".into()));
        }
        let mut shards: Vec<Shard> = Vec::new();
        for path in files {
            let mut shard = open_shard(&path)?;
            if let Some(first) = shards.first() {
                agree(&shard.path, &shard.columns, &first.path, &first.columns)?;
            }
            shard.bucket = shards.iter().position(|s| s.columns == shard.columns).unwrap_or(shards.len());
            shards.push(shard);
        }
        let firsts: Vec<usize> = shards.iter().scan(0, |n, s| Some(std::mem::replace(n, *n + s.samples))).collect();
        let samples = shards.iter().map(|s| s.samples).sum();
        Ok(Dataset { shards, firsts, samples, touched: Cell::new(0) })
    }

    /// The samples of all shards.
    pub fn len(&self) -> usize {
        self.samples
    }

    pub fn is_empty(&self) -> bool {
        self.samples == 0
    }

    /// The first shard's tensor `name` (the dtype is every shard's; the per-sample shape its
    /// bucket's).
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.shards.first()?.columns.get(name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.shards.first().map_or(Vec::new(), |s| s.columns.keys().map(|k| k.as_str()).collect())
    }

    /// The bucket of sample `i`: samples of one bucket have the same per-sample shapes.
    pub fn bucket_of(&self, i: usize) -> usize {
        self.shards[self.firsts.partition_point(|&f| f <= i) - 1].bucket
    }

    /// The buckets, in order: for each, its first shard's path, its first sample and its samples
    /// among the first `n`.
    pub fn buckets(&self, n: usize) -> Vec<Bucket<'_>> {
        let mut out: BTreeMap<usize, Bucket<'_>> = BTreeMap::new();
        for (s, &first) in self.shards.iter().zip(&self.firsts) {
            let here = (first + s.samples).min(n).saturating_sub(first);
            let b = out.entry(s.bucket).or_insert(Bucket { path: &s.path, first: None, samples: 0 });
            b.samples += here;
            if s.samples > 0 && b.first.is_none() {
                b.first = Some(first);
            }
        }
        out.into_values().collect()
    }

    /// The files, for messages: the one file, or the first and the count.
    pub fn describe(&self) -> String {
        match self.shards.as_slice() {
            [one] => one.path.display().to_string(),
            [first, ..] => format!("{} (and {} more shards)", first.path.display(), self.shards.len() - 1),
            [] => String::new(),
        }
    }

    /// Samples `idx` (numbered across the shards, all of one bucket) of tensor `name`, each
    /// shaped `sample` where given (of the same size: images stored flat feed a `[1, 8, 8]`
    /// input), else as stored.
    pub fn rows(&self, name: &str, idx: &[usize], sample: Option<&[usize]>) -> HostTensor {
        let shard_of = |i: usize| self.firsts.partition_point(|&f| f <= i) - 1;
        let col =
            idx.first().map_or_else(|| &self.shards[0].columns[name], |&i| &self.shards[shard_of(i)].columns[name]);
        let row = col.row_bytes();
        let mut bytes = Vec::with_capacity(idx.len() * row);
        for &i in idx {
            let s = shard_of(i);
            let shard = &self.shards[s];
            debug_assert_eq!(&shard.columns[name], col, "a batch of samples of two buckets");
            let at = shard.starts[name] + (i - self.firsts[s]) * row;
            bytes.extend_from_slice(&shard.map[at..at + row]);
        }
        self.touch(idx.len() as u64 * (row as u64 + 2 * FAULT_AROUND));
        let shape = [&[idx.len()], sample.unwrap_or(&col.sample)].concat();
        HostTensor::from_le_bytes(col.dtype, shape, &bytes)
    }

    /// Counts pages read; past [`RELEASE_EVERY`], hands every shard's resident pages back (they
    /// stay in the file cache, out of this process's resident set).
    fn touch(&self, bytes: u64) {
        let t = self.touched.get() + bytes;
        if t < RELEASE_EVERY {
            self.touched.set(t);
            return;
        }
        self.touched.set(0);
        #[cfg(unix)]
        for s in &self.shards {
            // SAFETY: the map is a read-only mapping of a file and no borrow of its bytes outlives
            // `rows`; dropped pages read back from the file, unchanged. A failure (an old kernel)
            // only leaves the pages resident.
            let _ = unsafe { s.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }
}

/// The files `p` names: itself, or where its file name holds `*` or `?`, the files of its folder
/// that match, sorted (none is an error naming the pattern).
fn expand(p: &Path) -> Result<Vec<PathBuf>> {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !name.contains(['*', '?']) {
        return Ok(vec![p.to_owned()]);
    }
    let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let entries = std::fs::read_dir(dir).map_err(|e| Error::Usage(format!("{}: {e}", dir.display())))?;
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| matches(&name, n)))
        .map(|e| e.path())
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(Error::Usage(format!("{}: no file matches", p.display())));
    }
    Ok(out)
}

/// Whether `name` matches `pattern` (`*` any run of characters, `?` one).
fn matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic backtracking match over the last `*`.
    let (mut i, mut j, mut star, mut from) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            (i, j) = (i + 1, j + 1);
        } else if i < p.len() && p[i] == '*' {
            (star, from, i) = (Some(i), j, i + 1);
        } else if let Some(s) = star {
            (i, from, j) = (s + 1, from + 1, from + 1);
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Maps one shard and reads its header.
fn open_shard(path: &Path) -> Result<Shard> {
    let usage = |m: String| Error::Usage(format!("{}: {m}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| usage(e.to_string()))?;
    // SAFETY: a read-only map; a shard changed or truncated while mpc trains on it would change
    // what it reads (or fault), as with any tool that maps its inputs.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| usage(e.to_string()))?;
    // Batches read rows in a shuffled order: no read-ahead (advice only; a failure changes nothing).
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    let (header, meta) =
        safetensors::SafeTensors::read_metadata(&map).map_err(|e| usage(format!("not a safetensors file: {e}")))?;
    let (mut columns, mut starts, mut samples) = (BTreeMap::new(), HashMap::new(), None::<(String, usize)>);
    for (name, info) in meta.tensors() {
        let dtype = crate::run::from_st(info.dtype)
            .ok_or_else(|| usage(format!("tensor `{name}`: dtype {:?} is not supported", info.dtype)))?;
        let Some((&n, sample)) = info.shape.split_first() else {
            return Err(usage(format!("tensor `{name}` has no sample dimension")));
        };
        match &samples {
            Some((other, m)) if *m != n => {
                return Err(usage(format!("tensor `{name}` has {n} samples, `{other}` has {m}")));
            }
            _ => samples = Some((name.clone(), n)),
        }
        starts.insert(name.clone(), 8 + header + info.data_offsets.0);
        columns.insert(name, Column { dtype, sample: sample.to_vec() });
    }
    let samples = samples.map_or(0, |s| s.1);
    Ok(Shard { path: path.to_owned(), map, columns, bucket: 0, starts, samples })
}

/// Checks that shard `path`'s columns are those of the first shard (the names, the dtypes, the
/// ranks of the samples): one line naming the shard and the tensor where they are not. Per-sample
/// sizes may differ (another bucket); whether they fit the model is the trainer's to say.
fn agree(path: &Path, cols: &BTreeMap<String, Column>, first: &Path, want: &BTreeMap<String, Column>) -> Result<()> {
    let bad = |m: String| Err(Error::Usage(format!("{}: {m}", path.display())));
    let first = first.display();
    for (name, w) in want {
        match cols.get(name) {
            None => return bad(format!("no tensor `{name}`, which {first} has")),
            Some(c) if c.dtype != w.dtype => {
                return bad(format!("tensor `{name}` is {}, in {first} it is {}", c.dtype, w.dtype))
            }
            Some(c) if c.sample.len() != w.sample.len() => {
                return bad(format!("tensor `{name}` has samples of shape {:?}, in {first} {:?}", c.sample, w.sample))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = cols.keys().find(|k| !want.contains_key(*k)) {
        return bad(format!("tensor `{extra}`, which {first} does not have"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_match_as_a_shell_does() {
        for (p, n, m) in [
            ("shard-*.safetensors", "shard-001.safetensors", true),
            ("shard-*.safetensors", "shard-001.json", false),
            ("*", "x", true),
            ("s??", "s01", true),
            ("s??", "s1", false),
            ("a*b*c", "abxbc", true),
            ("a*b*c", "acb", false),
        ] {
            assert_eq!(matches(p, n), m, "{p} {n}");
        }
    }
}
