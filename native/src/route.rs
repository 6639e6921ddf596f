//! One cohort of a route in one call: nodes that share a hash configuration and group layout, the
//! request's hash list per group, and for every node holding any of those blocks its hybrid hit on
//! GPU and on any medium plus, per group, the blocks used and the media they sit on. The rules are
//! the ones `processors/router/rows.py: node_row` applies to held-position sets (and `hit::find_hit`,
//! `gpu/hit.py`'s); the router's benchmark checks both paths answer alike on every request.
//!
//! Per position of each list the store's inverted view gives the holding slots; a slot's member
//! and medium class (cached with the member table while the store's slots stay the same) put a bit
//! into that member's per-group bitsets. Nodes holding nothing cost nothing here.

use std::sync::{Arc, Mutex};

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::hit::{find_hit, Held, Kind, Layout};
use crate::store::Store;

/// Media in answers: a mask with bit `id` for a slot's medium id (ids below `MEDIA_BITS`), and
/// these two bits for GPU and for blocks on no medium known.
pub const GPU_BIT: u64 = 1 << 62;
pub const UNKNOWN_BIT: u64 = 1 << 63;
pub const MEDIA_BITS: u32 = 62;

/// A cohort's nodes: their owner keys (`store::SlotMeta::owner`) and which of the cohort's spec
/// models each runs. Built once per cohort and kept by the caller while its nodes hold still.
pub struct Members {
    pub owners: Vec<u32>,
    pub models: Vec<u16>,
    by_owner: HashMap<u32, usize, RandomState>,
    /// Per slot id of one store, which member and medium class it counts for, and the non-GPU
    /// media those classes stand for; rebuilt when the store's slots change (`Store::slot_version`).
    slots: Mutex<Option<Arc<SlotMap>>>,
    /// The per-call bitsets, kept zeroed between calls (only touched members' parts are cleared
    /// after use), so a call neither allocates nor clears them whole: a few of them, since route
    /// threads search one cohort at once.
    scratch: Mutex<Vec<Vec<u64>>>,
}

/// A slot's member (`NOT_MEMBER` when it belongs to no node of the cohort, or is closed) and its
/// medium class: 0 GPU, `c` ≥ 1 the medium `media[c - 1]`.
#[derive(Clone, Copy)]
struct SlotEntry {
    member: u32,
    class: u32,
}

const NOT_MEMBER: u32 = u32::MAX;

struct SlotMap {
    store: u64,
    version: u64,
    /// Per slot id, its bitset row `member * classes + class` (`NOT_MEMBER` for none): one read
    /// per held pair in `route_cohort`'s inner loop instead of two and a multiply.
    rows: Vec<u32>,
    media: Vec<u16>,
}

impl Members {
    pub fn new(owners: Vec<u32>, models: Vec<u16>) -> Result<Self, String> {
        if owners.len() != models.len() {
            return Err("owners and models differ in length".into());
        }
        let mut by_owner = HashMap::with_capacity_and_hasher(owners.len(), RandomState::default());
        by_owner.extend(owners.iter().enumerate().map(|(i, &o)| (o, i)));
        Ok(Members {
            owners,
            models,
            by_owner,
            slots: Mutex::new(None),
            scratch: Mutex::new(Vec::new()),
        })
    }

    /// The slot map for `store` as it is now: the cached one while no slot was opened or closed.
    fn slot_map(&self, store: &Store) -> Arc<SlotMap> {
        let mut cached = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = cached.as_ref() {
            if m.store == store.serial() && m.version == store.slot_version() {
                return m.clone();
            }
        }
        let mut media: Vec<u16> = Vec::new();
        let entries = (0..store.slot_capacity() as u32)
            .map(|sid| {
                let Some(meta) = store.meta(sid) else {
                    return SlotEntry {
                        member: NOT_MEMBER,
                        class: 0,
                    };
                };
                let Some(&m) = self.by_owner.get(&meta.owner) else {
                    return SlotEntry {
                        member: NOT_MEMBER,
                        class: 0,
                    };
                };
                let class = if meta.gpu {
                    0
                } else {
                    match media.iter().position(|&id| id == meta.medium) {
                        Some(at) => at + 1,
                        None => {
                            media.push(meta.medium);
                            media.len()
                        }
                    }
                };
                SlotEntry {
                    member: m as u32,
                    class: class as u32,
                }
            })
            .collect::<Vec<SlotEntry>>();
        let classes = 1 + media.len() as u32;
        let rows = entries
            .iter()
            .map(|e| match e.member {
                NOT_MEMBER => NOT_MEMBER,
                m => m * classes + e.class,
            })
            .collect();
        let map = Arc::new(SlotMap {
            store: store.serial(),
            version: store.slot_version(),
            rows,
            media,
        });
        *cached = Some(map.clone());
        map
    }
}

/// Per spec model of a cohort, for this request: its layout id, the cap and the tokens hashed.
pub struct ModelArgs {
    pub layout: usize,
    pub cap: i64,
    pub num_hashed: i64,
}

pub struct GroupOut {
    pub gpu_blocks: usize,
    pub blocks: usize,
    pub media: u64,
    /// With `prefixes`: per medium the node holds in this group (-1 GPU, else the medium id) the
    /// longest held prefix in blocks, and the longest on any medium.
    pub prefix: Option<(Vec<(i64, usize)>, usize)>,
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

pub struct NodeOut {
    pub member: usize,
    pub gpu_tokens: i64,
    pub any_tokens: i64,
    pub groups: Vec<GroupOut>,
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
/// members' sets over the shortest list), as (hit tokens, per group (start, end)).
fn hit_on(
    layout: &Layout,
    sets: &[Vec<u64>],
    lens: &[usize],
    cap: i64,
    num_hashed: i64,
) -> (i64, Vec<(usize, usize)>) {
    // a spec group of one member reads that member's set as it is (bits past its length are
    // never set); several members' sets are intersected over the shortest list
    let mut words: Vec<Vec<u64>> = Vec::new();
    let mut at: Vec<Option<usize>> = Vec::with_capacity(layout.spec_groups.len());
    for sg in &layout.spec_groups {
        if sg.members.len() == 1 {
            at.push(None);
            continue;
        }
        let len = sg.members.iter().map(|&m| lens[m]).min().unwrap_or(0);
        let n = len.div_ceil(64).max(1);
        let mut w = vec![u64::MAX; n];
        for &m in &sg.members {
            w.iter_mut().zip(&sets[m]).for_each(|(a, b)| *a &= b);
        }
        // bits at or past `len` are never probed by the finders; clear them all the same
        if len % 64 != 0 {
            w[n - 1] &= (1u64 << (len % 64)) - 1;
        } else if len == 0 {
            w[0] = 0;
        }
        at.push(Some(words.len()));
        words.push(w);
    }
    let held: Vec<Held> = layout
        .spec_groups
        .iter()
        .zip(&at)
        .map(|(sg, a)| match a {
            None => Held {
                bits: &sets[sg.members[0]],
                len: lens[sg.members[0]],
            },
            Some(i) => Held {
                bits: &words[*i],
                len: sg.members.iter().map(|&m| lens[m]).min().unwrap_or(0),
            },
        })
        .collect();
    let (found, hit) = find_hit(layout, &held, cap, num_hashed);
    let mut spans = vec![(0usize, 0usize); layout.groups];
    for (sg, f) in layout.spec_groups.iter().zip(found) {
        for &m in &sg.members {
            spans[m] = (f.start, f.end);
        }
    }
    (hit, spans)
}

/// `lists[k]` is group k's (group id, keys) in the layouts' group order; `media_rank[id]` orders
/// the non-GPU media (the router lists them by name); `prefixes` adds each group's longest held
/// prefixes (the prefix-per-group semantics). Returns the nodes holding anything, in member order.
///
/// One pass over the (position, holding slot) pairs sets bits in one flat array: per member, per
/// medium class, per group, a bitset over the group's positions. The slot → (member, class) map is
/// kept with the member table, so a pair costs an array read and an OR.
pub fn route_cohort(
    store: &Store,
    layouts: &[Layout],
    lists: &[(u64, Vec<u64>)],
    members: &Members,
    models: &[ModelArgs],
    media_rank: &[u32],
    prefixes: bool,
) -> Result<Vec<NodeOut>, String> {
    let groups = lists.len();
    if members.models.iter().any(|&m| m as usize >= models.len()) {
        return Err("a member's model index past the models given".into());
    }
    for m in models {
        let layout = layouts
            .get(m.layout)
            .ok_or_else(|| format!("unknown layout id {}", m.layout))?;
        if layout.groups != groups {
            return Err(format!(
                "layout {} has {} groups, the cohort {groups}",
                m.layout, layout.groups
            ));
        }
    }
    let map = members.slot_map(store);
    if map.media.iter().any(|&id| id as u32 >= MEDIA_BITS) {
        return Err(format!(
            "a medium id past {MEDIA_BITS}: the caller reads media the reference way"
        ));
    }
    let classes = 1 + map.media.len();
    let lens: Vec<usize> = lists.iter().map(|(_, keys)| keys.len()).collect();
    let words: Vec<usize> = lens.iter().map(|l| l.div_ceil(64).max(1)).collect();
    // group k's bitset of (member m, class c) at `((m * classes + c) * per) + off[k]`
    let mut off = Vec::with_capacity(groups);
    let mut per = 0usize;
    for &w in &words {
        off.push(per);
        per += w;
    }
    let nm = members.owners.len();
    // a call that panicked may have left bits set: start that buffer afresh
    // A zeroed buffer from the member table's pool (a new one when every kept one is in use by
    // another thread), given back zeroed at the end; a call that panicked takes its buffer with it.
    let mut own: Vec<u64> = members
        .scratch
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_default();
    let bits: &mut Vec<u64> = &mut own;
    if bits.len() != nm * classes * per {
        bits.clear();
        bits.resize(nm * classes * per, 0);
    }
    // Rows (member, class) that got a bit, a byte each: a plain store per held pair. (A bit per
    // member ORed into a word made every pair wait on the previous pair's write to that word.)
    let mut row_seen = vec![0u8; nm * classes];
    let rows = &map.rows[..];
    for (k, (group, keys)) in lists.iter().enumerate() {
        let base = off[k];
        store.for_each_held_word(*group, keys, |sid, word, mask| {
            let Some(&r) = rows.get(sid as usize) else {
                return; // a slot opened after the map was made cannot be (the map is current)
            };
            if r == NOT_MEMBER {
                return;
            }
            let r = r as usize;
            bits[r * per + base + word] |= mask;
            row_seen[r] = 1;
        });
    }
    let mut touched = vec![0u64; nm.div_ceil(64)];
    for (r, _) in row_seen.iter().enumerate().filter(|(_, &x)| x != 0) {
        let m = r / classes;
        touched[m >> 6] |= 1 << (m & 63);
    }
    // the media classes in the router's order (by rank of the medium id)
    let mut order: Vec<usize> = (1..classes).collect();
    order.sort_by_key(|&c| {
        media_rank
            .get(map.media[c - 1] as usize)
            .copied()
            .unwrap_or(u32::MAX)
    });
    let mut any: Vec<Vec<u64>> = words.iter().map(|&n| vec![0; n]).collect();
    let mut gpu: Vec<Vec<u64>> = words.iter().map(|&n| vec![0; n]).collect();
    let mut left: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    for (tw, &word) in touched.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let mi = tw * 64 + word.trailing_zeros() as usize;
            word &= word - 1;
            let at = |c: usize, k: usize| -> &[u64] {
                let s = (mi * classes + c) * per + off[k];
                &bits[s..s + words[k]]
            };
            let mut off_gpu = false;
            for k in 0..groups {
                gpu[k].copy_from_slice(at(0, k));
                any[k].copy_from_slice(at(0, k));
                for c in 1..classes {
                    for (a, b) in any[k].iter_mut().zip(at(c, k)) {
                        off_gpu |= *b != 0;
                        *a |= b;
                    }
                }
            }
            let m = &models[members.models[mi] as usize];
            let layout = &layouts[m.layout];
            let has_full = layout.spec_groups.iter().any(|sg| sg.kind == Kind::Full);
            let (any_tokens, any_spans) = hit_on(layout, &any, &lens, m.cap, m.num_hashed);
            // one search when the node holds nothing off GPU (the sets are equal); none when it
            // holds nothing on GPU and the layout has full attention (its hit needs every block up
            // to the hit: none held, no hit); the GPU spans are then never read
            let (gpu_tokens, gpu_spans) = if !off_gpu {
                (any_tokens, any_spans.clone())
            } else if has_full && gpu.iter().all(|w| w.iter().all(|&x| x == 0)) {
                (0, Vec::new())
            } else {
                hit_on(layout, &gpu, &lens, m.cap, m.num_hashed)
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
                    range_bits(&mut left, words[k], s, e);
                    left.iter_mut().zip(&gpu[k]).for_each(|(a, b)| *a &= !b);
                    let mut n_left = ones(&left);
                    if n_left < used {
                        media |= GPU_BIT;
                    }
                    for &c in &order {
                        if n_left == 0 {
                            break;
                        }
                        let held = at(c, k);
                        let found: usize = left
                            .iter()
                            .zip(held)
                            .map(|(a, b)| (a & b).count_ones() as usize)
                            .sum();
                        if found > 0 {
                            media |= 1 << map.media[c - 1];
                            left.iter_mut().zip(held).for_each(|(a, b)| *a &= !b);
                            n_left -= found;
                        }
                    }
                    if n_left > 0 {
                        media |= UNKNOWN_BIT;
                    }
                }
                let prefix = prefixes.then(|| {
                    let per = (0..classes)
                        .filter(|&c| at(c, k).iter().any(|&w| w != 0))
                        .map(|c| {
                            let id = if c == 0 { -1 } else { map.media[c - 1] as i64 };
                            (id, leading_ones(at(c, k)))
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
            out.push(NodeOut {
                member: mi,
                gpu_tokens,
                any_tokens,
                groups: per_group,
            });
        }
    }
    // zero again what this call set (only touched members have bits), for the next call
    for (tw, &word) in touched.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let mi = tw * 64 + word.trailing_zeros() as usize;
            word &= word - 1;
            bits[mi * classes * per..(mi + 1) * classes * per].fill(0);
        }
    }
    let mut pool = members.scratch.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < SCRATCH_KEPT {
        pool.push(own);
    }
    Ok(out)
}

/// Zeroed buffers a member table keeps: one per route thread that may search its cohort at once.
const SCRATCH_KEPT: usize = 8;
