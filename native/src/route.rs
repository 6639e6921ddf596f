//! One cohort of a route in one call: nodes that share a hash configuration and group layout, the
//! request's hash list per group, and for every node holding any of those blocks its hybrid hit on
//! GPU and on any medium plus, per group, the blocks used and the media they sit on. The rules are
//! the ones `processors/router/rows.py: node_row` applies to held-position sets (and `hit::find_hit`,
//! `gpu/hit.py`'s); the router's benchmark checks both paths answer alike on every request.
//!
//! Per position of each list the store's inverted view gives the holding slots; a slot's member
//! and medium class (cached with the member table while the store's slots stay the same) put a bit
//! into that member's per-group bitsets. Nodes holding nothing cost nothing here. Each touched
//! member's answer is then worked out from its bitsets (`memberhit.rs`), all of them, or with a
//! `Prune` (a decision showing its best few rows: `topk.rs: Bar`) the highest bounds first while
//! they can still rank among the rows shown.

use std::sync::{Arc, Mutex};

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::hit::Layout;
use crate::memberhit::{Scratch, Sets};
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
    /// The per-call buffers, the bitsets and row marks kept zeroed between calls (only touched
    /// members' parts are cleared after use), so a call neither allocates nor clears them whole: a
    /// few of them, since route threads search one cohort at once.
    scratch: Mutex<Vec<Work>>,
}

/// One search's buffers, reused from call to call.
#[derive(Default)]
struct Work {
    bits: Vec<u64>,
    /// Rows (member, class) that got a bit, a byte each: a plain store per held pair. (A bit per
    /// member ORed into a word made every pair wait on the previous pair's write to that word.)
    row_seen: Vec<u8>,
    touched: Vec<usize>,
    by_bound: Vec<((i64, i64), usize)>,
    member: Scratch,
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

pub struct NodeOut {
    pub member: usize,
    pub gpu_tokens: i64,
    pub any_tokens: i64,
    pub groups: Vec<GroupOut>,
}

/// A cohort search's answer: the nodes holding anything, in member order, except those a `Prune`
/// left out, listed apart with the bound their hit on any medium stays under.
pub struct CohortOut {
    pub nodes: Vec<NodeOut>,
    pub skipped: Vec<(usize, i64)>,
}

/// Lets a caller that shows only the best few nodes leave out members that cannot be among them:
/// asked once per member holding anything, the highest bounds first, with bounds on the member's
/// hit in tokens on GPU and on any medium; told every member worked out.
pub trait Prune {
    fn skip(&mut self, member: usize, gpu: i64, any: i64) -> bool;
    fn seen(&mut self, node: &NodeOut);
}

/// `lists[k]` is group k's (group id, keys) in the layouts' group order; `media_rank[id]` orders
/// the non-GPU media (the router lists them by name); `prefixes` adds each group's longest held
/// prefixes (the prefix-per-group semantics); `prune`, where given, may leave members out.
///
/// One pass over the (position, holding slot) pairs sets bits in one flat array: per member, per
/// medium class, per group, a bitset over the group's positions. The slot → (member, class) map is
/// kept with the member table, so a pair costs an array read and an OR.
// the request's parts and the caller's hook, each a plain argument: both callers pass them straight through
#[allow(clippy::too_many_arguments)]
pub fn route_cohort(
    store: &Store,
    layouts: &[Layout],
    lists: &[(u64, &[u64])],
    members: &Members,
    models: &[ModelArgs],
    media_rank: &[u32],
    prefixes: bool,
    prune: Option<&mut dyn Prune>,
) -> Result<CohortOut, String> {
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
    // Zeroed buffers from the member table's pool (new ones when every kept set is in use by
    // another thread), given back zeroed at the end; a call that panicked takes its set with it.
    let mut own: Work = members
        .scratch
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_default();
    let Work {
        bits,
        row_seen,
        touched: members_touched,
        by_bound,
        member: scratch,
    } = &mut own;
    if bits.len() != nm * classes * per {
        bits.clear();
        bits.resize(nm * classes * per, 0);
    }
    if row_seen.len() != nm * classes {
        row_seen.clear();
        row_seen.resize(nm * classes, 0);
    }
    members_touched.clear();
    scratch.fit(&words);
    let rows = &map.rows[..];
    for (k, (group, keys)) in lists.iter().enumerate() {
        let base = off[k];
        store.for_each_held_word(*group, keys, |holders, word, mask| {
            let at = base + word;
            for &sid in holders {
                // a slot opened after the map was made cannot be (the map is current)
                let Some(&r) = rows.get(sid as usize) else {
                    continue;
                };
                if r == NOT_MEMBER {
                    continue;
                }
                let r = r as usize;
                bits[r * per + at] |= mask;
                row_seen[r] = 1;
            }
        });
    }
    // the members with a bit, in member order (a member's rows are consecutive); the marks are
    // cleared for the next call as they are read
    for (r, seen) in row_seen.iter_mut().enumerate() {
        if *seen == 0 {
            continue;
        }
        *seen = 0;
        let m = r / classes;
        if members_touched.last() != Some(&m) {
            members_touched.push(m);
        }
    }
    // the media classes in the router's order (by rank of the medium id)
    let mut order: Vec<usize> = (1..classes).collect();
    order.sort_by_key(|&c| {
        media_rank
            .get(map.media[c - 1] as usize)
            .copied()
            .unwrap_or(u32::MAX)
    });
    let (nodes, skipped) = {
        let sets = Sets {
            bits,
            classes,
            per,
            off: &off,
            words: &words,
            lens: &lens,
            media: &map.media,
            order: &order,
        };
        let model = |mi: usize| &models[members.models[mi] as usize];
        let mut nodes = Vec::with_capacity(members_touched.len());
        let mut skipped = Vec::new();
        match prune {
            None => {
                for &mi in members_touched.iter() {
                    let m = model(mi);
                    nodes.push(sets.node(mi, m, &layouts[m.layout], prefixes, scratch));
                }
            }
            Some(prune) => {
                // the highest bounds first (ties in member order), so the bar rises early
                by_bound.clear();
                by_bound.extend(members_touched.iter().map(|&mi| {
                    (
                        sets.bounds(mi, &layouts[model(mi).layout], model(mi).cap),
                        mi,
                    )
                }));
                by_bound.sort_unstable_by(|a, b| {
                    (b.0 .0 + b.0 .1)
                        .cmp(&(a.0 .0 + a.0 .1))
                        .then(a.1.cmp(&b.1))
                });
                for &((gpu, any), mi) in by_bound.iter() {
                    if prune.skip(mi, gpu, any) {
                        skipped.push((mi, any));
                        continue;
                    }
                    let m = model(mi);
                    let n = sets.node(mi, m, &layouts[m.layout], prefixes, scratch);
                    prune.seen(&n);
                    nodes.push(n);
                }
                nodes.sort_unstable_by_key(|n| n.member);
            }
        }
        (nodes, skipped)
    };
    // zero again what this call set (only touched members have bits), for the next call
    for &mi in members_touched.iter() {
        bits[mi * classes * per..(mi + 1) * classes * per].fill(0);
    }
    let mut pool = members.scratch.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < SCRATCH_KEPT {
        pool.push(own);
    }
    Ok(CohortOut { nodes, skipped })
}

/// Zeroed buffers a member table keeps: one per route thread that may search its cohort at once.
const SCRATCH_KEPT: usize = 8;
