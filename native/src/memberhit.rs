//! One member's answer from the bitsets a cohort search filled (`route::route_cohort`): its hybrid
//! hit on GPU and on any medium, per group the blocks used and the media they sit on, and with the
//! prefix-per-group semantics each medium's longest held prefix. Also a cheap bound on the hit, so
//! a decision asking for the best few nodes can leave out the members that cannot be among them.

use crate::hit::{
    find_hit_into, is_fine_grained, supports_fine_grained, Held, HitBufs, Kind, Layout,
};
use crate::route::{GroupOut, ModelArgs, NodeOut, GPU_BIT, UNKNOWN_BIT};

/// The filled bitsets of one search: group k's set of (member m, class c) at
/// `((m * classes + c) * per) + off[k]`, `words[k]` words over `lens[k]` positions; class 0 is
/// GPU, class c ≥ 1 the medium `media[c - 1]`, `order` the non-GPU classes by the router's rank.
pub(crate) struct Sets<'a> {
    pub bits: &'a [u64],
    pub classes: usize,
    pub per: usize,
    pub off: &'a [usize],
    pub words: &'a [usize],
    pub lens: &'a [usize],
    pub media: &'a [u16],
    pub order: &'a [usize],
}

/// Buffers reused from member to member of one search (and kept from search to search).
#[derive(Default)]
pub(crate) struct Scratch {
    any: Vec<Vec<u64>>,
    gpu: Vec<Vec<u64>>,
    left: Vec<u64>,
    /// per spec group of several members: the intersection of their sets
    words: Vec<Vec<u64>>,
    hit: HitBufs,
    any_spans: Vec<(usize, usize)>,
    gpu_spans: Vec<(usize, usize)>,
}

impl Scratch {
    /// Sized for a search of `words[k]` words per group k (every word is written before it is read).
    pub fn fit(&mut self, words: &[usize]) {
        for sets in [&mut self.any, &mut self.gpu] {
            sets.resize_with(words.len(), Vec::new);
            for (w, &n) in sets.iter_mut().zip(words) {
                w.resize(n, 0);
            }
        }
    }
}

impl Sets<'_> {
    #[inline]
    fn at(&self, mi: usize, c: usize, k: usize) -> &[u64] {
        let s = (mi * self.classes + c) * self.per + self.off[k];
        &self.bits[s..s + self.words[k]]
    }

    /// Bounds on member `mi`'s hit in tokens (`hit::find_hit` never ends a hit past what a group
    /// holds), on GPU and on any medium: `cap`, the held prefix of each full-attention group
    /// listed per block, and below the last block a sliding-window, Mamba or fine-grained
    /// full-attention group holds, the end of that block (every such finder ends its hit on a
    /// held entry). Chunked local attention can hit past its last held block: no bound from it.
    pub fn bounds(&self, mi: usize, layout: &Layout, cap: i64) -> (i64, i64) {
        let (classes, per) = (self.classes, self.per);
        let row = &self.bits[mi * classes * per..(mi + 1) * classes * per];
        // group k's word w: on GPU, and on any medium
        let word = |k: usize, w: usize| {
            let at = self.off[k] + w;
            let gpu = row[at];
            (gpu, (1..classes).fold(gpu, |a, c| a | row[c * per + at]))
        };
        let (mut gpu_ub, mut any_ub) = (cap, cap);
        for sg in &layout.spec_groups {
            let fine =
                supports_fine_grained(sg.kind) && is_fine_grained(sg.block_size, layout.alignment);
            let unit = if fine {
                layout.alignment
            } else {
                sg.block_size
            };
            for &k in &sg.members {
                let (gpu, any) = match sg.kind {
                    Kind::Chunked { .. } => continue,
                    Kind::Full if !fine => {
                        // the held prefixes: leading ones
                        let (mut lead, mut gpu_open) = ((0, 0), true);
                        for w in 0..self.words[k] {
                            let (g, a) = word(k, w);
                            if gpu_open {
                                lead.0 += g.trailing_ones() as usize;
                                gpu_open = g == u64::MAX;
                            }
                            lead.1 += a.trailing_ones() as usize;
                            if a != u64::MAX {
                                break; // the GPU prefix ended here or before
                            }
                        }
                        lead
                    }
                    _ => {
                        // past the last held entry: from the top word down
                        let (mut gpu, mut any) = (None, None);
                        for w in (0..self.words[k]).rev() {
                            let (g, a) = word(k, w);
                            let end = |x: u64| w * 64 + 64 - x.leading_zeros() as usize;
                            if gpu.is_none() && g != 0 {
                                gpu = Some(end(g));
                            }
                            if any.is_none() && a != 0 {
                                any = Some(end(a));
                            }
                            if gpu.is_some() {
                                break; // any is set too: a GPU bit is a bit on any medium
                            }
                        }
                        (gpu.unwrap_or(0), any.unwrap_or(0))
                    }
                };
                let tokens = |n: usize| n.min(self.lens[k]) as i64 * unit;
                gpu_ub = gpu_ub.min(tokens(gpu));
                any_ub = any_ub.min(tokens(any));
            }
        }
        (gpu_ub, any_ub)
    }

    /// Member `mi`'s answer.
    pub fn node(
        &self,
        mi: usize,
        model: &ModelArgs,
        layout: &Layout,
        prefixes: bool,
        s: &mut Scratch,
    ) -> NodeOut {
        let groups = self.lens.len();
        let Scratch {
            any,
            gpu,
            left,
            words,
            hit,
            any_spans,
            gpu_spans,
        } = s;
        let mut off_gpu = false;
        for k in 0..groups {
            gpu[k].copy_from_slice(self.at(mi, 0, k));
            any[k].copy_from_slice(self.at(mi, 0, k));
            for c in 1..self.classes {
                for (a, b) in any[k].iter_mut().zip(self.at(mi, c, k)) {
                    off_gpu |= *b != 0;
                    *a |= b;
                }
            }
        }
        let has_full = layout.spec_groups.iter().any(|sg| sg.kind == Kind::Full);
        let (cap, hashed) = (model.cap, model.num_hashed);
        let any_tokens = hit_on(layout, any, self.lens, cap, hashed, words, hit, any_spans);
        // one search when the node holds nothing off GPU (the sets are equal); none when it
        // holds nothing on GPU and the layout has full attention (its hit needs every block up
        // to the hit: none held, no hit); the GPU spans are then never read
        let gpu_tokens = if !off_gpu {
            gpu_spans.clone_from(any_spans);
            any_tokens
        } else if has_full && gpu.iter().all(|w| w.iter().all(|&x| x == 0)) {
            0
        } else {
            hit_on(layout, gpu, self.lens, cap, hashed, words, hit, gpu_spans)
        };
        let mut per_group = Vec::with_capacity(groups);
        for k in 0..groups {
            let (s, e) = if any_tokens != 0 {
                any_spans[k]
            } else {
                (0, 0)
            };
            let gpu_blocks = if gpu_tokens != 0 {
                gpu_spans[k].1 - gpu_spans[k].0.min(gpu_spans[k].1)
            } else {
                0
            };
            let used = e.saturating_sub(s);
            let mut media = 0u64;
            if used > 0 {
                // each used block's medium: GPU if there, else the first other medium (by
                // rank) holding it, else unknown
                range_bits(left, self.words[k], s, e);
                left.iter_mut().zip(&gpu[k]).for_each(|(a, b)| *a &= !b);
                let mut n_left = ones(left);
                if n_left < used {
                    media |= GPU_BIT;
                }
                for &c in self.order {
                    if n_left == 0 {
                        break;
                    }
                    let held = self.at(mi, c, k);
                    let found: usize = left
                        .iter()
                        .zip(held)
                        .map(|(a, b)| (a & b).count_ones() as usize)
                        .sum();
                    if found > 0 {
                        media |= 1 << self.media[c - 1];
                        left.iter_mut().zip(held).for_each(|(a, b)| *a &= !b);
                        n_left -= found;
                    }
                }
                if n_left > 0 {
                    media |= UNKNOWN_BIT;
                }
            }
            let prefix = prefixes.then(|| {
                let per = (0..self.classes)
                    .filter(|&c| self.at(mi, c, k).iter().any(|&w| w != 0))
                    .map(|c| {
                        let id = if c == 0 { -1 } else { self.media[c - 1] as i64 };
                        (id, leading_ones(self.at(mi, c, k)))
                    })
                    .collect();
                (per, leading_ones(&any[k]))
            });
            per_group.push(GroupOut {
                gpu_blocks,
                blocks: used,
                media,
                prefix,
            });
        }
        NodeOut {
            member: mi,
            gpu_tokens,
            any_tokens,
            groups: per_group,
        }
    }
}

/// How many positions from 0 are set in a row.
fn leading_ones(bits: &[u64]) -> usize {
    let mut n = 0;
    for &w in bits {
        let run = w.trailing_ones() as usize;
        n += run;
        if run < 64 {
            break;
        }
    }
    n
}

/// `w` set to `words` words with bits `start..end` on (a word at a time).
fn range_bits(w: &mut Vec<u64>, words: usize, start: usize, end: usize) {
    w.clear();
    w.resize(words, 0);
    let mut i = start;
    while i < end {
        let shift = i & 63;
        let n = (64 - shift).min(end - i);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << shift
        };
        w[i >> 6] |= mask;
        i += n;
    }
}

fn ones(bits: &[u64]) -> usize {
    bits.iter().map(|w| w.count_ones() as usize).sum()
}

/// The hybrid hit of `layout` on per-group bitsets (each spec group: the intersection of its
/// members' sets over the shortest list, made in `words`), in tokens; per group its (start, end)
/// left in `spans`.
// the buffers are the caller's, reused from node to node: each a plain argument
#[allow(clippy::too_many_arguments)]
fn hit_on(
    layout: &Layout,
    sets: &[Vec<u64>],
    lens: &[usize],
    cap: i64,
    num_hashed: i64,
    words: &mut Vec<Vec<u64>>,
    bufs: &mut HitBufs,
    spans: &mut Vec<(usize, usize)>,
) -> i64 {
    let shortest = |members: &[usize]| members.iter().map(|&m| lens[m]).min().unwrap_or(0);
    // a spec group of one member reads that member's set as it is (bits past its length are
    // never set); several members' sets are intersected over the shortest list
    if words.len() < layout.spec_groups.len() {
        words.resize_with(layout.spec_groups.len(), Vec::new);
    }
    for (sg, w) in layout.spec_groups.iter().zip(words.iter_mut()) {
        if sg.members.len() == 1 {
            continue;
        }
        let len = shortest(&sg.members);
        let n = len.div_ceil(64).max(1);
        w.clear();
        w.resize(n, u64::MAX);
        for &m in &sg.members {
            w.iter_mut().zip(&sets[m]).for_each(|(a, b)| *a &= b);
        }
        // bits at or past `len` are never probed by the finders; clear them all the same
        if len % 64 != 0 {
            w[n - 1] &= (1u64 << (len % 64)) - 1;
        } else if len == 0 {
            w[0] = 0;
        }
    }
    let words = &*words;
    let held = |k: usize| {
        let sg = &layout.spec_groups[k];
        match sg.members[..] {
            [m] => Held {
                bits: &sets[m],
                len: lens[m],
            },
            _ => Held {
                bits: &words[k],
                len: shortest(&sg.members),
            },
        }
    };
    let hit = find_hit_into(layout, held, cap, num_hashed, bufs);
    spans.clear();
    spans.resize(layout.groups, (0, 0));
    for (sg, f) in layout.spec_groups.iter().zip(&bufs.found) {
        for &m in &sg.members {
            spans[m] = (f.start, f.end);
        }
    }
    hit
}
