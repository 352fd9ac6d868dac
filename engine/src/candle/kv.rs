//! Keys and values a stage holds, as plain rows, and the attention of every
//! query row of a step computed in one pass per layer over all of them.
//!
//! ```text
//!  a sequence's layer:  k, v = [position][kv head][head dim]   (token-major, f16; a
//!                       step appends its rows, capacity grows by whole chunks)
//!
//!  one step, one layer:  q rows of every sequence (a prompt's several, a
//!                        decoding sequence's one)
//!      ─► threads over (row × query head): scores against the keys the row
//!         sees (up to its own position) in place, softmax, weighted sum of
//!         the values ─► output rows
//! ```
//!
//! Keys and values are held as f16 by default (as llama.cpp holds them):
//! at a long context they are most of what a decoding step reads, and
//! half the bytes is nearly half the time; f32 on request (checking the
//! model's definition against an f32 reference). A row is widened to f32
//! once per task (a block of rows and KV head, or query head) and chunk of
//! keys, for all the rows and query heads the task takes; the sums run in
//! f32.
//!
//! A sliding layer forgets the rows no later query can see (but a window
//! more, for the prefix cache): once a window's worth of them can go, they
//! are dropped from the front (the rest moved down, the buffer kept), so
//! such a layer holds about three windows and a step's rows at most,
//! however long the sequence.
//!
//! Decoding is where many sequences meet: reading each cache where it lies
//! replaces a score of small tensor operations per sequence and layer (split,
//! copy, append, two products, softmax) with one loop, so a batch of 32
//! costs the arithmetic and not the bookkeeping. A prompt's rows take the
//! same loop, so a row's result never depends on what runs beside it.

use super::kv_rows::KvRows;
use crate::error::{Error, Result};
use crate::stage::KvPrecision;

/// One layer's keys and values of one sequence.
pub(super) struct LayerKv {
    k: KvRows,
    v: KvRows,
    /// Floats per token: KV heads × head dim.
    width: usize,
    /// Latent attention: no values of their own; each token's value is the
    /// first this many floats of its key row (one KV head).
    values_in_keys: Option<usize>,
    /// The position of the first row held (rows before it were forgotten).
    start: usize,
}

impl LayerKv {
    pub fn new(width: usize, precision: KvPrecision) -> Self {
        LayerKv {
            k: KvRows::new(precision),
            v: KvRows::new(precision),
            width,
            values_in_keys: None,
            start: 0,
        }
    }

    /// Empty, to hold rows from position `start` on (a sliding layer seeded
    /// from the prefix cache with only the blocks its window reaches).
    pub fn start_at(&mut self, start: usize) {
        debug_assert!(self.k.is_empty());
        self.start = start;
    }

    /// A cache of latent attention's rows of `width` floats, whose first
    /// `values` floats are also the values.
    pub fn latent(width: usize, values: usize, precision: KvPrecision) -> Self {
        LayerKv {
            values_in_keys: Some(values.min(width)),
            ..LayerKv::new(width, precision)
        }
    }

    /// Where position `t`'s row begins in the buffers.
    fn at(&self, t: usize) -> usize {
        debug_assert!(
            t >= self.start,
            "row {t} was forgotten (from {})",
            self.start
        );
        (t - self.start) * self.width
    }

    /// Token `t`'s value row of KV head `group`, widened into `out` (its
    /// `dim` floats).
    fn value(&self, t: usize, group: usize, out: &mut [f32]) {
        let dim = out.len();
        match self.values_in_keys {
            Some(_) => self.k.widen(self.at(t)..self.at(t) + dim, out),
            None => {
                let at = self.at(t) + group * dim;
                self.v.widen(at..at + dim, out)
            }
        }
    }

    /// Positions covered: one past the last row held.
    pub fn len(&self) -> usize {
        self.start + self.k.len() / self.width
    }

    /// The first position held.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Forgets the rows before `position` (no query will see them) once at
    /// least `lag` of them are held, so moving the rest down is paid once
    /// per `lag` tokens.
    pub fn forget_before(&mut self, position: usize, lag: usize) {
        let position = position.min(self.len());
        if position < self.start + lag.max(1) {
            return;
        }
        let rows = (position - self.start) * self.width;
        self.k.drop_front(rows);
        if self.values_in_keys.is_none() {
            self.v.drop_front(rows);
        }
        self.start = position;
    }

    /// Bytes reserved (what the sequence costs, not only what it uses).
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    /// Appends the rows of `k` and `v` (whole tokens), growing the buffers
    /// by whole chunks of `chunk` tokens; running out of memory is an error,
    /// not an abort.
    pub fn append(&mut self, k: &[f32], v: &[f32], chunk: usize) -> Result<()> {
        self.reserve(k.len(), v.len(), chunk)?;
        self.k.extend(k);
        self.v.extend(v);
        Ok(())
    }

    /// [`LayerKv::append`] for rows held in a [`KvRows`] (a prefix-cache
    /// block's, from [`LayerKv::rows`]): in the same precision, the very
    /// bits they held.
    pub fn append_rows(&mut self, k: &KvRows, v: &KvRows, chunk: usize) -> Result<()> {
        self.reserve(k.len(), v.len(), chunk)?;
        self.k.extend_from(k);
        self.v.extend_from(v);
        Ok(())
    }

    /// Room for `keys` and `values` more floats, grown by whole chunks of
    /// `chunk` tokens.
    fn reserve(&mut self, keys: usize, values: usize, chunk: usize) -> Result<()> {
        let own_values = self.values_in_keys.is_none();
        debug_assert_eq!(values, if own_values { keys } else { 0 });
        debug_assert_eq!(keys % self.width, 0);
        let needed = self.k.len() + keys;
        if needed > self.k.capacity() {
            let tokens = needed.div_ceil(self.width).div_ceil(chunk) * chunk;
            let more = tokens * self.width - self.k.len();
            let buffers = if own_values {
                vec![&mut self.k, &mut self.v]
            } else {
                vec![&mut self.k]
            };
            for buffer in buffers {
                buffer.try_reserve_exact(more).map_err(|e| {
                    Error::InvalidInput(format!("no memory for {tokens} tokens of KV cache: {e}"))
                })?;
            }
        }
        Ok(())
    }

    /// A copy of the rows of tokens `range` (a prefix-cache block), in the
    /// precision held (so appending them again stores the same bits);
    /// `None` when some were forgotten.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Option<(KvRows, KvRows)> {
        if range.start < self.start {
            return None;
        }
        let span = self.at(range.start)..self.at(range.end);
        let v = match self.values_in_keys {
            Some(_) => self.v.slice(0..0),
            None => self.v.slice(span.clone()),
        };
        Some((self.k.slice(span), v))
    }
}

/// One query row in a layer: its sequence's cache (this step's keys and
/// values already appended) and the keys it sees, `first..end` (`end` is
/// one past the query's own position).
pub(super) struct QueryRow<'a> {
    pub q: &'a [f32],
    pub kv: &'a LayerKv,
    pub first: usize,
    pub end: usize,
}

/// The heads of one layer's attention, and the scale of its scores.
pub(super) struct HeadShape {
    pub heads: usize,
    pub kv_heads: usize,
    /// Floats of a query or key head.
    pub head_dim: usize,
    /// Floats of a value head (the head dim, but for latent attention).
    pub value_dim: usize,
    pub scale: f32,
}

/// Rows of one sequence a thread takes together: each key and value is
/// read once for all of them rather than once per row.
const BLOCK_ROWS: usize = 16;

/// Keys a piece takes at most: a row's keys are cut at the multiples of
/// this (of their positions) and the pieces' softmaxes merged in position
/// order, so one long sequence's attention is spread over the threads, and
/// how a row is cut depends neither on what runs beside it nor on what a
/// sliding layer forgot.
const KEY_CHUNK: usize = 256;

/// Attention of query rows (of any sequences, several per sequence when a
/// prompt runs) against their caches, written into `out` (`rows × heads ×
/// value dim`). Work comes in units: a block of rows (a decoding
/// sequence's one row, or up to [`BLOCK_ROWS`] of a prompt's) with every
/// query head of one KV head, so each key and value is read once for all
/// the query heads that share it (at a long context the keys and values
/// are most of what a step reads). A unit runs its [`KEY_CHUNK`]s of keys
/// in position order; when there are fewer units than threads (one long
/// sequence decoding), its chunks run on threads of their own, merged in
/// the same order after. When even that leaves fewer pieces than threads
/// (a single short sequence of a model with one KV head), threads take one
/// query head at a time. Each head of each row is summed in the same order
/// whatever else runs, and either way.
pub(super) fn attend_rows(
    rows: &[QueryRow<'_>],
    shape: &HeadShape,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let threads = super::pool::threads();
    let cut = Cut::of(rows);
    let chunks: usize = cut.chunks.iter().map(Vec::len).sum();
    let grouped = chunks * shape.kv_heads >= threads;
    let units = cut.blocks.len() * if grouped { shape.kv_heads } else { shape.heads };
    attend_rows_as(rows, &cut, shape, sinks, out, (grouped, units < threads));
}

/// How a step's rows are cut: into blocks, and each block's keys into
/// chunks.
struct Cut {
    blocks: Vec<std::ops::Range<usize>>,
    chunks: Vec<Vec<std::ops::Range<usize>>>,
}

impl Cut {
    fn of(rows: &[QueryRow<'_>]) -> Cut {
        let blocks = blocks(rows);
        let chunks = blocks.iter().map(|b| chunks(&rows[b.clone()])).collect();
        Cut { blocks, chunks }
    }
}

/// Runs of consecutive rows on the same cache (one prompt's), cut short at
/// [`BLOCK_ROWS`].
fn blocks(rows: &[QueryRow<'_>]) -> Vec<std::ops::Range<usize>> {
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        match blocks.last_mut() {
            Some(b) if b.len() < BLOCK_ROWS && std::ptr::eq(rows[b.start].kv, row.kv) => {
                b.end = i + 1
            }
            _ => blocks.push(i..i + 1),
        }
    }
    blocks
}

/// The chunks of keys a block's rows see, in position order.
fn chunks(block: &[QueryRow<'_>]) -> Vec<std::ops::Range<usize>> {
    let lo = block.iter().map(|r| r.first).min().unwrap_or(0);
    let hi = block.iter().map(|r| r.end).max().unwrap_or(0);
    (lo / KEY_CHUNK..hi.div_ceil(KEY_CHUNK))
        .map(|c| (c * KEY_CHUNK).max(lo)..((c + 1) * KEY_CHUNK).min(hi))
        .collect()
}

/// Attention over some of the keys, per (head, row), head-major: the
/// largest score, the sum of `exp(score - max)`, and the output over those
/// keys alone (`value dim` each: the values weighted by their softmax over
/// them, so that a row whose keys all lie in one chunk is computed as it
/// was without chunks — but for a sink, whose share is now taken after).
/// A row that sees none of the keys has a sum of 0.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    /// Over no keys, for `pairs` (head, row) pairs.
    fn empty(pairs: usize, vd: usize) -> Partial {
        Partial {
            max: vec![f32::NEG_INFINITY; pairs],
            sum: vec![0.0; pairs],
            acc: vec![0.0; pairs * vd],
        }
    }

    /// Takes in `other`, over later keys of the same rows and heads.
    fn merge(&mut self, other: &Partial, vd: usize) {
        for j in 0..self.max.len() {
            if other.sum[j] == 0.0 {
                continue;
            }
            let acc = &mut self.acc[j * vd..(j + 1) * vd];
            let more = &other.acc[j * vd..(j + 1) * vd];
            if self.sum[j] == 0.0 {
                acc.copy_from_slice(more);
                (self.max[j], self.sum[j]) = (other.max[j], other.sum[j]);
                continue;
            }
            let max = self.max[j].max(other.max[j]);
            let a = self.sum[j] * (self.max[j] - max).exp();
            let b = other.sum[j] * (other.max[j] - max).exp();
            let sum = a + b;
            let (a, b) = (a / sum, b / sum);
            for (x, y) in acc.iter_mut().zip(more) {
                *x = *x * a + y * b;
            }
            (self.max[j], self.sum[j]) = (max, sum);
        }
    }
}

/// [`attend_rows`], the query heads of a KV head taken together or one by
/// one (`grouped`), a unit's chunks on threads of their own or not
/// (`split`).
fn attend_rows_as(
    rows: &[QueryRow<'_>],
    Cut { blocks, chunks }: &Cut,
    shape: &HeadShape,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    (grouped, split): (bool, bool),
) {
    let (heads, vd) = (shape.heads, shape.value_dim);
    let rep = heads / shape.kv_heads;
    debug_assert_eq!(out.len(), rows.len() * heads * vd);
    let per_unit = if grouped { rep } else { 1 };
    // Units (a block and the first of its query heads), and the chunks of
    // keys each task takes of its unit: all of them, or one.
    let mut units = Vec::new();
    let mut tasks = Vec::new();
    for (b, chunks) in chunks.iter().enumerate() {
        for h in (0..heads).step_by(per_unit) {
            match split {
                true => tasks.extend((0..chunks.len()).map(|c| (units.len(), &chunks[c..=c]))),
                false => tasks.push((units.len(), &chunks[..])),
            }
            units.push((b, h));
        }
    }
    let partials: Vec<Partial> = super::pool::run(tasks.len(), |task| {
        let (u, chunks) = &tasks[task];
        let (b, h) = units[*u];
        let block = &rows[blocks[b].clone()];
        let mut whole = Partial::empty(per_unit * block.len(), vd);
        for keys in chunks.iter() {
            let part = attend_block(block, (h..h + per_unit, h / rep), keys.clone(), shape);
            whole.merge(&part, vd);
        }
        whole
    });
    // Each unit's tasks merged in position order, then the sink (a logit
    // per head that joins the softmax without a value).
    out.fill(0.0);
    let mut at = 0;
    for (u, &(b, h)) in units.iter().enumerate() {
        let n = blocks[b].len();
        let mut whole = Partial::empty(per_unit * n, vd);
        while at < tasks.len() && tasks[at].0 == u {
            whole.merge(&partials[at], vd);
            at += 1;
        }
        for j in 0..per_unit * n {
            let (head, r) = (h + j / n, blocks[b].start + j % n);
            let (max, sum) = (whole.max[j], whole.sum[j]);
            if sum == 0.0 {
                continue;
            }
            let to = &mut out[(r * heads + head) * vd..(r * heads + head + 1) * vd];
            let acc = &whole.acc[j * vd..(j + 1) * vd];
            match sinks.map(|s| s[head]) {
                // The sink's share of the softmax goes to no value.
                Some(sink) => {
                    let top = max.max(sink);
                    let kept = sum * (max - top).exp();
                    let share = kept / (kept + (sink - top).exp());
                    for (o, a) in to.iter_mut().zip(acc) {
                        *o = a * share;
                    }
                }
                None => to.copy_from_slice(acc),
            }
        }
    }
}

/// Query heads `heads` (of KV head `group`) of a block of rows on one
/// cache against the keys `keys`: each row's scores, softmax terms and
/// weighted values in key order, exactly as they would be for the row and
/// the head alone; each key and value read once for all of them.
fn attend_block(
    block: &[QueryRow<'_>],
    (heads, group): (std::ops::Range<usize>, usize),
    keys: std::ops::Range<usize>,
    shape: &HeadShape,
) -> Partial {
    let (kv, hd, vd) = (block[0].kv, shape.head_dim, shape.value_dim);
    let n = block.len();
    let at = |t: usize| kv.at(t) + group * hd;
    // (head, row) pairs, head-major; the keys each row sees of the chunk.
    let qs: Vec<&[f32]> = heads
        .clone()
        .flat_map(|h| block.iter().map(move |r| &r.q[h * hd..(h + 1) * hd]))
        .collect();
    let seen: Vec<std::ops::Range<usize>> = block
        .iter()
        .map(|r| r.first.max(keys.start)..r.end.min(keys.end))
        .collect();
    let mut scores: Vec<Vec<f32>> = heads
        .clone()
        .flat_map(|_| seen.iter().map(|s| Vec::with_capacity(s.len())))
        .collect();
    // A key or value row widened once for every (head, row) pair.
    let mut wide = vec![0f32; hd.max(vd)];
    for t in keys.clone() {
        let k = &mut wide[..hd];
        kv.k.widen(at(t)..at(t) + hd, k);
        for (j, (q, s)) in qs.iter().zip(scores.iter_mut()).enumerate() {
            if seen[j % n].contains(&t) {
                s.push(dot(q, k) * shape.scale);
            }
        }
    }
    let mut part = Partial::empty(scores.len(), vd);
    for (j, s) in scores.iter_mut().enumerate() {
        if s.is_empty() {
            continue;
        }
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        (part.max[j], part.sum[j]) = (max, sum);
    }
    for t in keys {
        let v = &mut wide[..vd];
        kv.value(t, group, v);
        for (j, s) in scores.iter().enumerate() {
            let seen = &seen[j % n];
            if seen.contains(&t) {
                let weight = s[t - seen.start] / part.sum[j];
                axpy(weight, v, &mut part.acc[j * vd..(j + 1) * vd]);
            }
        }
    }
    part
}

/// `a · b`, in eight lanes the compiler keeps in one vector register.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y += a · x`.
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: softmax(q·kᵀ·scale)·v per head, keys
    /// `first..end`; with a sink, one more term in the softmax's sum.
    fn reference(
        q: &[f32],
        kv: &LayerKv,
        (first, end): (usize, usize),
        (heads, kv_heads, hd): (usize, usize, usize),
        scale: f32,
        sinks: Option<&[f32]>,
    ) -> Vec<f32> {
        let rep = heads / kv_heads;
        let mut out = vec![0f32; heads * hd];
        for h in 0..heads {
            let g = h / rep;
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (first..end)
                .map(|t| {
                    let at = t * kv.width + g * hd;
                    let k = kv.k.to_f32_vec(at..at + hd);
                    qh.iter()
                        .zip(k)
                        .map(|(a, b)| f64::from(*a) * f64::from(b))
                        .sum::<f64>()
                        * f64::from(scale)
                })
                .collect();
            let sink = sinks.map(|s| f64::from(s[h]));
            let max = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            for (i, t) in (first..end).enumerate() {
                let at = t * kv.width + g * hd;
                let v = kv.v.to_f32_vec(at..at + hd);
                for d in 0..hd {
                    out[h * hd + d] += (e[i] / sum * f64::from(v[d])) as f32;
                }
            }
        }
        out
    }

    /// Values in [-1, 1) that an f16 holds exactly.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 512.0 - 1.0)
            .collect()
    }

    #[test]
    fn attention_matches_the_definition_for_mixed_rows() {
        let (heads, kv_heads, hd) = (9, 3, 20);
        let width = kv_heads * hd;
        // Three sequences of different lengths; one sees a window only.
        let caches: Vec<LayerKv> = [5usize, 300, 37]
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                let mut kv = LayerKv::new(width, KvPrecision::F16);
                // Appended in pieces, across chunk boundaries.
                for piece in values(n * width, s as u32).chunks(7 * width) {
                    let v: Vec<f32> = piece.iter().map(|x| x * 0.5).collect();
                    kv.append(piece, &v, 16).unwrap();
                }
                assert_eq!(kv.len(), n);
                assert_eq!(kv.bytes(), 2 * n.div_ceil(16) * 16 * width * 2);
                kv
            })
            .collect();
        // Decoding rows (all keys), one in a window, and two rows of a
        // prompt that see only the keys up to their own.
        let spans = [
            (0, 0, 5),
            (1, 0, 300),
            (2, 37 - 8, 37),
            (1, 0, 120),
            (1, 100, 121),
            // Across the cut between two chunks of keys.
            (1, 250, 270),
        ];
        let qs: Vec<Vec<f32>> = (0..spans.len())
            .map(|s| values(heads * hd, 99 + s as u32))
            .collect();
        let rows: Vec<QueryRow> = spans
            .iter()
            .zip(&qs)
            .map(|(&(c, first, end), q)| QueryRow {
                q,
                kv: &caches[c],
                first,
                end,
            })
            .collect();
        let shape = HeadShape {
            heads,
            kv_heads,
            head_dim: hd,
            value_dim: hd,
            scale: 0.125,
        };
        // Sinks above and below the scores, so they take visible weight.
        let sinks: Vec<f32> = (0..heads).map(|h| h as f32 - 4.0).collect();
        for sinks in [None, Some(sinks.as_slice())] {
            let mut out = vec![f32::NAN; spans.len() * heads * hd];
            attend_rows(&rows, &shape, sinks, &mut out);
            // The query heads of a KV head taken together or one by one:
            // the same bits.
            // A unit's chunks on threads of their own or not: the same bits.
            for ways in [(false, false), (false, true), (true, false), (true, true)] {
                let mut again = vec![f32::NAN; out.len()];
                attend_rows_as(&rows, &Cut::of(&rows), &shape, sinks, &mut again, ways);
                let same = again
                    .iter()
                    .zip(&out)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "grouped, split {ways:?}, sinks {sinks:?}");
            }
            for (s, &(c, first, end)) in spans.iter().enumerate() {
                let want = reference(
                    &qs[s],
                    &caches[c],
                    (first, end),
                    (heads, kv_heads, hd),
                    0.125,
                    sinks,
                );
                let got = &out[s * heads * hd..(s + 1) * heads * hd];
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "row {s}, sinks {sinks:?}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn rows_read_back_what_was_appended_in_the_bytes_of_their_precision() {
        for precision in [KvPrecision::F16, KvPrecision::F32] {
            let mut kv = LayerKv::new(8, precision);
            let k = values(5 * 8, 1);
            let v = values(5 * 8, 2);
            kv.append(&k, &v, 4).unwrap();
            let (rk, rv) = kv.rows(1..3).unwrap();
            assert_eq!(rk.to_f32_vec(0..16), k[8..24]);
            assert_eq!(rv.to_f32_vec(0..16), v[8..24]);
            assert_eq!(rk.held_bytes(), 16 * precision.bytes());
            // Appended to a cache of either precision: the same values,
            // held in its own.
            for other in [KvPrecision::F16, KvPrecision::F32] {
                let mut copy = LayerKv::new(8, other);
                copy.append_rows(&rk, &rv, 4).unwrap();
                let (ck, cv) = copy.rows(0..2).unwrap();
                assert_eq!(
                    (ck.to_f32_vec(0..16), cv.to_f32_vec(0..16)),
                    (k[8..24].to_vec(), v[8..24].to_vec())
                );
                assert_eq!(ck.held_bytes(), 16 * other.bytes());
            }
            let mut value = [0f32; 4];
            kv.value(4, 1, &mut value);
            assert_eq!(value, v[4 * 8 + 4..4 * 8 + 8]);
            let floats = 8 * 8 * 2; // two chunks of 4 tokens, keys and values
            let bytes = match precision {
                KvPrecision::F16 => 2,
                KvPrecision::F32 => 4,
            };
            assert_eq!(kv.bytes(), floats * bytes);
        }
    }

    #[test]
    fn an_f16_cache_rounds_and_saturates_what_it_holds_an_f32_one_keeps_it() {
        let x = [0.1f32, 1e6, -1e6, 0.0, 0.0, 0.0, 0.0, 0.0];
        for (precision, held) in [
            (KvPrecision::F16, [0.099975586, 65504.0, -65504.0]),
            (KvPrecision::F32, [0.1, 1e6, -1e6]),
        ] {
            let mut kv = LayerKv::new(8, precision);
            kv.append(&x, &x, 1).unwrap();
            assert_eq!(
                kv.rows(0..1).unwrap().0.to_f32_vec(0..3),
                held,
                "{precision:?}"
            );
        }
    }

    #[test]
    fn a_sliding_layer_forgets_old_rows_and_attends_as_before() {
        let (heads, kv_heads, hd, window) = (4, 2, 8, 5);
        let width = kv_heads * hd;
        let shape = HeadShape {
            heads,
            kv_heads,
            head_dim: hd,
            value_dim: hd,
            scale: 0.3,
        };
        let (mut all, mut sliding) = (
            LayerKv::new(width, KvPrecision::F16),
            LayerKv::new(width, KvPrecision::F16),
        );
        let (mut max_held, mut max_bytes) = (0, 0);
        for t in 0..400 {
            let (k, v) = (values(width, 2 * t), values(width, 2 * t + 1));
            all.append(&k, &v, 16).unwrap();
            // What the engine does before a step's rows go in: forget what
            // the step's query (at t) cannot see.
            sliding.forget_before((t as usize + 1).saturating_sub(window), window);
            sliding.append(&k, &v, 16).unwrap();
            assert_eq!(sliding.len(), t as usize + 1);
            max_held = max_held.max(sliding.len() - sliding.start());
            max_bytes = max_bytes.max(sliding.bytes());
            let q = values(heads * hd, 1000 + t);
            let first = (t as usize + 1).saturating_sub(window);
            let mut outs = [vec![0f32; heads * hd], vec![0f32; heads * hd]];
            for (kv, out) in [&all, &sliding].into_iter().zip(&mut outs) {
                let row = QueryRow {
                    q: &q,
                    kv,
                    first,
                    end: t as usize + 1,
                };
                attend_rows(&[row], &shape, None, out);
            }
            let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&outs[0]), bits(&outs[1]), "position {t}");
        }
        assert!(
            max_held < 2 * window,
            "held {max_held} rows of a window of {window}"
        );
        assert_eq!(
            max_bytes,
            2 * 16 * width * 2,
            "one chunk of 16 rows (f16), never more"
        );
        // Blocks before the window are gone; those within it read back.
        assert_eq!(sliding.rows(0..4), None);
        assert_eq!(sliding.rows(398..400), all.rows(398..400));
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it() {
        // Past a cut between chunks of keys, with and without sinks.
        let (heads, kv_heads, hd, n) = (6, 2, 16, 300);
        let mut kv = LayerKv::new(kv_heads * hd, KvPrecision::F16);
        kv.append(&values(n * 32, 3), &values(n * 32, 4), 16)
            .unwrap();
        let qs: Vec<Vec<f32>> = (0..n).map(|i| values(heads * hd, 7 + i as u32)).collect();
        let shape = HeadShape {
            heads,
            kv_heads,
            head_dim: hd,
            value_dim: hd,
            scale: 0.25,
        };
        let row = |i: usize| QueryRow {
            q: &qs[i],
            kv: &kv,
            first: 0,
            end: i + 1,
        };
        let sinks: Vec<f32> = (0..heads).map(|h| h as f32 - 2.0).collect();
        // All the rows of a prompt at once, against rows alone (one before
        // the cut, one on it, one past it).
        let all: Vec<QueryRow> = (0..n).map(row).collect();
        let width = heads * hd;
        let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for sinks in [None, Some(sinks.as_slice())] {
            let mut together = vec![0f32; n * width];
            attend_rows(&all, &shape, sinks, &mut together);
            for i in [40, 255, 256, 270] {
                let mut alone = vec![0f32; width];
                attend_rows(&[row(i)], &shape, sinks, &mut alone);
                assert_eq!(
                    bits(&together[i * width..(i + 1) * width]),
                    bits(&alone),
                    "row {i}, sinks {sinks:?}"
                );
            }
        }
    }
}
