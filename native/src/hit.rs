//! The hybrid prefix-cache hit on block positions: the rules of `gpu/hit.py` (the readable
//! reference, which a property test holds this module equal to), for the router's use where a
//! group's list entry `i` is "the request's block i" and `held(i)` says whether the node holds it.
//!
//! A found list in the reference is, per spec group, null slots then real blocks; every finder
//! produces `[None] * start + [block] * (end - start)` (possibly cut below `start` by alignment
//! pops), so it is returned as the interval `Found { start, end }`: mask length `end`, real slots
//! `start..end`.

/// The types of prefix-cacheable group, with their one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Full,
    Sliding { window: i64 },
    Mamba,
    Chunked { chunk: i64 },
}

/// Groups with equal specs, looked up together (`gpu.hit.SpecGroup`); `members` index the
/// node's groups as passed to a search.
#[derive(Clone, Debug)]
pub struct SpecGroup {
    pub kind: Kind,
    pub block_size: i64,
    pub eagle: bool,
    pub members: Vec<usize>,
}

/// A node's spec model: spec groups in search order (full attention first) and where hits land.
#[derive(Clone, Debug)]
pub struct Layout {
    pub groups: usize,
    pub spec_groups: Vec<SpecGroup>,
    pub alignment: i64,
}

/// Null slots `0..start` (start clamped to `end`), real blocks `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Found {
    pub start: usize,
    pub end: usize,
}

impl Found {
    fn new(start: usize, end: usize) -> Self {
        Found {
            start: start.min(end),
            end,
        }
    }
}

/// Held positions of one spec group's view (`len` entries; bits past it are never probed).
pub struct Held<'a> {
    pub bits: &'a [u64],
    pub len: usize,
}

impl Held<'_> {
    #[inline]
    fn has(&self, i: usize) -> bool {
        i < self.len && (self.bits[i >> 6] >> (i & 63)) & 1 == 1
    }

    /// How many positions from `from` up (below `limit`, itself at most `len`) are held in a row.
    #[inline]
    fn ones_up(&self, from: usize, limit: usize) -> usize {
        let mut i = from;
        while i < limit {
            let shift = i & 63;
            let run = (!(self.bits[i >> 6] >> shift)).trailing_zeros() as usize;
            let run = run.min(64 - shift);
            i += run;
            if run < 64 - shift {
                break;
            }
        }
        i.min(limit) - from
    }

    /// How many positions below `end` (at most `len`) are held in a row, at most `cap`.
    #[inline]
    fn ones_down(&self, end: usize, cap: usize) -> usize {
        let mut i = end;
        while i > 0 && end - i < cap {
            let top = (i - 1) & 63; // the highest bit to read in this word
            let w = self.bits[(i - 1) >> 6] << (63 - top); // bit i-1 now at 63
            let run = ((!w).leading_zeros() as usize).min(top + 1);
            i -= run;
            if run < top + 1 {
                break;
            }
        }
        (end - i).min(cap)
    }

    /// How many positions below `end` (at most `len`) are not held, in a row.
    #[inline]
    fn zeros_down(&self, end: usize) -> usize {
        let mut i = end;
        while i > 0 {
            let top = (i - 1) & 63;
            let w = self.bits[(i - 1) >> 6] << (63 - top);
            let run = (w.leading_zeros() as usize).min(top + 1);
            i -= run;
            if run < top + 1 {
                break;
            }
        }
        end - i
    }
}

fn cdiv(a: i64, b: i64) -> i64 {
    -((-a).div_euclid(b))
}

fn is_fine_grained(block_size: i64, alignment: i64) -> bool {
    alignment < block_size && block_size % alignment == 0
}

fn supports_fine_grained(kind: Kind) -> bool {
    matches!(kind, Kind::Full | Kind::Mamba)
}

/// Python's `//` for a non-negative divisor.
fn fdiv(a: i64, b: i64) -> i64 {
    a.div_euclid(b)
}

/// `min(a, len)` as a count: negative counts are empty.
fn count(a: i64, len: usize) -> usize {
    if a <= 0 {
        0
    } else {
        (a as usize).min(len)
    }
}

fn find_full(
    held: &Held,
    max_length: i64,
    bs: i64,
    alignment: i64,
    drop_eagle: bool,
) -> (Found, i64) {
    let fine = is_fine_grained(bs, alignment);
    let k = if fine { (bs / alignment) as usize } else { 1 };
    // Fine-grained: the list is at the hash unit; a whole block is its last unit's entry.
    let n_blocks = if held.len >= k {
        (held.len - k) / k + 1
    } else {
        0
    };
    let limit = count(fdiv(max_length, bs), n_blocks);
    let mut found = if k == 1 { held.ones_up(0, limit) } else { 0 };
    while found < limit && held.has(found * k + k - 1) {
        found += 1;
    }
    let mut hit = found as i64 * bs;
    if fine {
        // A partial entry inside the next block: its interior units, longest first.
        let first = found * k;
        let last = (first + k - 1)
            .min(count(fdiv(max_length, alignment), usize::MAX))
            .min(held.len);
        for j in (first..last).rev() {
            if held.has(j) {
                found += 1;
                hit = (j as i64 + 1) * alignment;
                break;
            }
        }
    }
    if drop_eagle && hit > 0 {
        hit -= alignment.min(bs);
    }
    hit -= hit.rem_euclid(alignment);
    let end = found.min(count(cdiv(hit, bs), usize::MAX));
    (Found::new(0, end), hit)
}

fn find_sliding(
    held: &Held,
    max_length: i64,
    bs: i64,
    window: i64,
    alignment: i64,
    drop_eagle: bool,
) -> (Found, i64) {
    let need = cdiv(window - 1, bs) + i64::from(drop_eagle);
    let n = count(fdiv(max_length, bs), held.len);
    let aligned_only = bs != alignment;
    let mut run = 0usize;
    let mut found: Option<Found> = None;
    if !aligned_only {
        // runs a word at a time, from the right: ones, then the zeros below them
        let need = need.max(1) as usize;
        let mut i = n;
        while i > 0 {
            let ones = held.ones_down(i, need - run);
            run += ones;
            i -= ones;
            if run >= need {
                found = Some(Found::new(i, i + run));
                break;
            }
            if i == 0 {
                break;
            }
            run = 0;
            i -= held.zeros_down(i);
        }
    }
    for i in (0..if aligned_only { n } else { 0 }).rev() {
        if run == 0 && aligned_only {
            // A run may only end (at its right) on an aligned boundary.
            let right = if drop_eagle { i } else { i + 1 } as i64;
            if (right * bs) % alignment != 0 {
                continue;
            }
        }
        if held.has(i) {
            run += 1;
            if run as i64 >= need {
                found = Some(Found::new(i, i + run));
                break;
            }
        } else {
            run = 0;
        }
    }
    let pop_unaligned = |f: &mut Found| {
        if aligned_only {
            while (f.end as i64 * bs) % alignment != 0 {
                f.end -= 1;
            }
            f.start = f.start.min(f.end);
        }
    };
    let mut f = match found {
        Some(f) => f,
        None => {
            // The run touching block 0, possibly empty.
            let mut f = Found::new(0, run);
            pop_unaligned(&mut f);
            f
        }
    };
    if drop_eagle && f.end > 0 {
        f.end -= 1;
        f.start = f.start.min(f.end);
        pop_unaligned(&mut f);
    }
    (f, f.end as i64 * bs)
}

fn find_mamba(held: &Held, max_length: i64, bs: i64, alignment: i64) -> (Found, i64) {
    if is_fine_grained(bs, alignment) {
        // The list is at the hash unit: any cached unit (block end or partial entry) is a state.
        let k = (bs / alignment) as usize;
        for j in (0..count(fdiv(max_length, alignment), held.len)).rev() {
            if held.has(j) {
                return (Found::new(j / k, j / k + 1), (j as i64 + 1) * alignment);
            }
        }
        return (Found::default(), 0);
    }
    let aligned_only = bs != alignment;
    for i in (0..count(fdiv(max_length, bs), held.len)).rev() {
        if aligned_only && ((i as i64 + 1) * bs) % alignment != 0 {
            continue;
        }
        if held.has(i) {
            return (Found::new(i, i + 1), (i as i64 + 1) * bs);
        }
    }
    (Found::default(), 0)
}

fn find_chunked(held: &Held, max_length: i64, bs: i64, chunk: i64) -> (Found, i64) {
    let n = count(fdiv(max_length, bs), held.len);
    let start_tokens = if max_length > 0 {
        fdiv(max_length, chunk) * chunk
    } else {
        0
    };
    let start = count(fdiv(start_tokens, bs), usize::MAX);
    let mut end = start;
    while end < n && held.has(end) {
        end += 1;
    }
    (Found::new(start, end), end as i64 * bs)
}

fn eagle_margin(sg: &SpecGroup, alignment: i64) -> i64 {
    if supports_fine_grained(sg.kind) && is_fine_grained(sg.block_size, alignment) {
        alignment
    } else {
        sg.block_size
    }
}

fn find_for(
    sg: &SpecGroup,
    held: &Held,
    max_length: i64,
    alignment: i64,
    drop: bool,
) -> (Found, i64) {
    let bs = sg.block_size;
    match sg.kind {
        Kind::Full => find_full(held, max_length, bs, alignment, drop),
        Kind::Sliding { window } => find_sliding(held, max_length, bs, window, alignment, drop),
        Kind::Mamba => find_mamba(held, max_length, bs, alignment),
        Kind::Chunked { chunk } => find_chunked(held, max_length, bs, chunk),
    }
}

/// The hybrid search (`gpu.hit.find_hit`): `held[k]` serves `layout.spec_groups[k]`. Returns the
/// found interval per spec group (full attention cut to the hit) and the hit length in tokens.
/// `num_hashed`: tokens the request's lists cover (the EAGLE margin never looks past it).
pub fn find_hit(
    layout: &Layout,
    held: &[Held],
    max_length: i64,
    num_hashed: i64,
) -> (Vec<Found>, i64) {
    let sgs = &layout.spec_groups;
    let alignment = layout.alignment;
    let mut hit = max_length;
    // per spec group: what it found (if looked up), its length, whether EAGLE's drop was checked
    // (one allocation: this runs per node per route)
    let mut state: Vec<(Option<Found>, i64, bool)> = vec![(None, 0, false); sgs.len()];
    let simple = sgs.len() == 2 && sgs[0].kind == Kind::Full;
    loop {
        let mut cur = hit;
        for (k, sg) in sgs.iter().enumerate() {
            if sg.kind == Kind::Full && state[k].0.is_some() {
                cur = cur.min(state[k].1); // downward closed: looked up once, then clamped
                continue;
            }
            let drop = sg.eagle && !state[k].2;
            let mut limit = cur;
            if drop && sg.kind != Kind::Mamba {
                limit = (cur + eagle_margin(sg, alignment)).min(num_hashed);
            }
            let (f, new_len) = find_for(sg, &held[k], limit, alignment, drop);
            if drop {
                state[k].2 = true;
            } else if new_len < cur {
                state.iter_mut().for_each(|v| v.2 = false);
            }
            cur = new_len;
            state[k].0 = Some(f);
            state[k].1 = new_len;
        }
        if cur >= hit {
            break;
        }
        hit = cur;
        if simple {
            break;
        }
    }
    let out = sgs
        .iter()
        .zip(state)
        .map(|(sg, (f, _, _))| {
            let mut f = f.unwrap_or_default();
            if sg.kind == Kind::Full {
                f.end = f.end.min(count(cdiv(hit, sg.block_size), usize::MAX));
                f.start = f.start.min(f.end);
            }
            f
        })
        .collect();
    (out, hit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(len: usize, held: &[usize]) -> Vec<u64> {
        let mut b = vec![0u64; len.div_ceil(64).max(1)];
        for &i in held {
            b[i >> 6] |= 1 << (i & 63);
        }
        b
    }

    fn sg(kind: Kind, block_size: i64, eagle: bool) -> SpecGroup {
        SpecGroup {
            kind,
            block_size,
            eagle,
            members: vec![0],
        }
    }

    #[test]
    fn full_attention_is_the_held_prefix() {
        let b = bits(8, &[0, 1, 2, 4]);
        let held = Held { bits: &b, len: 8 };
        assert_eq!(find_full(&held, 128, 16, 16, false), (Found::new(0, 3), 48));
        // the cap stops it: 40 tokens is two whole blocks
        assert_eq!(find_full(&held, 40, 16, 16, false), (Found::new(0, 2), 32));
        // EAGLE drops one block
        assert_eq!(find_full(&held, 128, 16, 16, true), (Found::new(0, 2), 32));
    }

    #[test]
    fn fine_grained_full_attention_probes_the_next_block() {
        // 64-token blocks, 16-token unit: block 0 whole (unit 3), then a partial entry at unit 5
        let b = bits(16, &[3, 5]);
        let held = Held { bits: &b, len: 16 };
        assert_eq!(
            find_full(&held, 1000, 64, 16, false),
            (Found::new(0, 2), 96)
        );
    }

    #[test]
    fn sliding_window_takes_the_rightmost_run() {
        // window 33 at block 16 needs 2 blocks: run 5..7 is the rightmost
        let b = bits(8, &[0, 1, 5, 6]);
        let held = Held { bits: &b, len: 8 };
        assert_eq!(
            find_sliding(&held, 128, 16, 33, 16, false),
            (Found::new(5, 7), 112)
        );
        // none long enough: the run touching block 0
        let b = bits(8, &[0, 3]);
        let held = Held { bits: &b, len: 8 };
        assert_eq!(
            find_sliding(&held, 128, 16, 33, 16, false),
            (Found::new(0, 1), 16)
        );
    }

    #[test]
    fn mamba_takes_the_last_aligned_state() {
        let b = bits(8, &[1, 2]);
        let held = Held { bits: &b, len: 8 };
        // alignment 32 at block 16: block 2 ends at 48, unaligned; block 1 ends at 32
        assert_eq!(find_mamba(&held, 128, 16, 32), (Found::new(1, 2), 32));
    }

    #[test]
    fn chunked_local_skips_earlier_chunks() {
        let b = bits(8, &[4, 5, 6]);
        let held = Held { bits: &b, len: 8 };
        // cap 100, chunk 64: the current chunk starts at block 4
        assert_eq!(find_chunked(&held, 100, 16, 64), (Found::new(4, 6), 96));
    }

    #[test]
    fn edge_cases_match_the_python_reference() {
        // expected values computed with gpu/hit.py's finders on the same inputs
        let b = bits(8, &[1, 2, 3, 4, 5]);
        let held = Held { bits: &b, len: 8 };
        // sliding window, EAGLE, hits aligned to 32 at block 16: run 2..5 ends aligned, one dropped
        assert_eq!(
            find_sliding(&held, 128, 16, 33, 32, true),
            (Found::new(2, 4), 64)
        );
        let b = bits(16, &[2, 9]);
        let held = Held { bits: &b, len: 16 };
        // fine-grained Mamba: the highest cached hash unit (9) is a partial entry in block 2
        assert_eq!(find_mamba(&held, 1000, 64, 16), (Found::new(2, 3), 160));
        let b = bits(16, &[3, 5]);
        let held = Held { bits: &b, len: 16 };
        // fine-grained full attention with EAGLE: 96 tokens found, one hash unit dropped
        assert_eq!(find_full(&held, 1000, 64, 16, true), (Found::new(0, 2), 80));
        let b = bits(3, &[0, 1, 2]);
        let held = Held { bits: &b, len: 3 };
        // chunked local whose current chunk starts past the list: null slots only, still counted
        assert_eq!(find_chunked(&held, 100, 16, 64), (Found::new(4, 4), 64));
    }

    #[test]
    fn hybrid_fixed_point_caps_full_attention_by_the_window() {
        let layout = Layout {
            groups: 2,
            spec_groups: vec![
                sg(Kind::Full, 16, false),
                sg(Kind::Sliding { window: 33 }, 16, false),
            ],
            alignment: 16,
        };
        let fa = bits(8, &[0, 1, 2, 3, 4, 5]);
        let sw = bits(8, &[1, 2]);
        let held = [Held { bits: &fa, len: 8 }, Held { bits: &sw, len: 8 }];
        let (found, hit) = find_hit(&layout, &held, 127, 128);
        assert_eq!(hit, 48);
        assert_eq!(found, vec![Found::new(0, 3), Found::new(1, 3)]);
    }
}
