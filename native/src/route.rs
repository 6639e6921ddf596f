//! One cohort of a route in one call: nodes that share a hash configuration and group layout, the
//! request's hash list per group, and for every node holding any of those blocks its hybrid hit on
//! GPU and on any medium plus, per group, the blocks used and the media they sit on. The rules are
//! the ones `processors/router/rows.py: node_row` applies to held-position sets (and `hit::find_hit`,
//! `gpu/hit.py`'s); the router's benchmark checks both paths answer alike on every request.
//!
//! Per position of each list the store's inverted view gives the holding slots; a slot's owner
//! and medium (`store::SlotMeta`) put a bit into that node's per-group bitsets (any medium, GPU,
//! and per other medium). Nodes holding nothing cost nothing here.

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::hit::{find_hit, Held, Kind, Layout};
use crate::store::Store;

/// Media ids in answers: a slot's medium id, or these two.
pub const GPU_ID: u32 = u32::MAX - 1;
pub const UNKNOWN: u32 = u32::MAX;

/// A cohort's nodes: their owner keys (`store::SlotMeta::owner`) and which of the cohort's spec
/// models each runs. Built once per cohort and kept by the caller while its nodes hold still.
pub struct Members {
    pub owners: Vec<u32>,
    pub models: Vec<u16>,
    by_owner: HashMap<u32, usize, RandomState>,
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
        })
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
    pub media: Vec<u32>,
}

pub struct NodeOut {
    pub member: usize,
    pub gpu_tokens: i64,
    pub any_tokens: i64,
    pub groups: Vec<GroupOut>,
}

struct Touch {
    any: Vec<Vec<u64>>,
    gpu: Vec<Vec<u64>>,
    media: Vec<Vec<(u16, Vec<u64>)>>,
}

#[inline]
fn set(bits: &mut [u64], i: usize) {
    bits[i >> 6] |= 1 << (i & 63);
}

fn range_bits(words: usize, start: usize, end: usize) -> Vec<u64> {
    let mut w = vec![0u64; words];
    for i in start..end {
        set(&mut w, i);
    }
    w
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
    let mut words: Vec<Vec<u64>> = Vec::with_capacity(layout.spec_groups.len());
    let mut views = Vec::with_capacity(layout.spec_groups.len());
    for sg in &layout.spec_groups {
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
        words.push(w);
        views.push(len);
    }
    let held: Vec<Held> = words
        .iter()
        .zip(&views)
        .map(|(w, &len)| Held { bits: w, len })
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
/// the non-GPU media (the router lists them by name). Returns the nodes holding anything, in
/// member order.
pub fn route_cohort(
    store: &Store,
    layouts: &[Layout],
    lists: &[(u64, Vec<u64>)],
    members: &Members,
    models: &[ModelArgs],
    media_rank: &[u32],
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
    let lens: Vec<usize> = lists.iter().map(|(_, keys)| keys.len()).collect();
    let words: Vec<usize> = lens.iter().map(|l| l.div_ceil(64).max(1)).collect();
    // owner → member, on a fast hasher (owner keys are ours, not the network's)
    let by_owner = &members.by_owner;
    let mut touched: Vec<Option<Box<Touch>>> = (0..members.owners.len()).map(|_| None).collect();
    // per slot id, its member (resolved on first sight): a slot is met once per position it holds
    const UNSEEN: u32 = u32::MAX;
    const NOT_MEMBER: u32 = u32::MAX - 1;
    let mut member_of: Vec<u32> = vec![UNSEEN; store.slot_capacity()];
    let mut meta_of: Vec<crate::store::SlotMeta> = vec![Default::default(); store.slot_capacity()];
    for (k, (group, keys)) in lists.iter().enumerate() {
        store.for_each_held(*group, keys, |sid, i| {
            let Some(seen) = member_of.get_mut(sid as usize) else {
                return;
            };
            if *seen == UNSEEN {
                *seen = match store.meta(sid) {
                    Some(meta) => {
                        meta_of[sid as usize] = meta;
                        by_owner.get(&meta.owner).map_or(NOT_MEMBER, |&m| m as u32)
                    }
                    None => NOT_MEMBER,
                };
            }
            if *seen == NOT_MEMBER {
                return;
            }
            let m = *seen as usize;
            let meta = meta_of[sid as usize];
            let t = touched[m].get_or_insert_with(|| {
                Box::new(Touch {
                    any: words.iter().map(|&n| vec![0; n]).collect(),
                    gpu: words.iter().map(|&n| vec![0; n]).collect(),
                    media: vec![Vec::new(); groups],
                })
            });
            set(&mut t.any[k], i);
            if meta.gpu {
                set(&mut t.gpu[k], i);
            } else {
                let per = &mut t.media[k];
                let at = match per.iter().position(|(id, _)| *id == meta.medium) {
                    Some(at) => at,
                    None => {
                        per.push((meta.medium, vec![0; words[k]]));
                        per.len() - 1
                    }
                };
                set(&mut per[at].1, i);
            }
        });
    }
    let mut out = Vec::new();
    for (mi, t) in touched.iter_mut().enumerate() {
        let Some(t) = t else { continue };
        let m = &models[members.models[mi] as usize];
        let layout = &layouts[m.layout];
        let has_full = layout.spec_groups.iter().any(|sg| sg.kind == Kind::Full);
        let (any_tokens, any_spans) = hit_on(layout, &t.any, &lens, m.cap, m.num_hashed);
        // one search when the node holds nothing off GPU (the sets are equal); none when it holds
        // nothing on GPU and the layout has full attention (its hit needs every block up to the
        // hit: none held, no hit); the GPU spans are then never read
        let (gpu_tokens, gpu_spans) = if t.media.iter().all(Vec::is_empty) {
            (any_tokens, any_spans.clone())
        } else if has_full && t.gpu.iter().all(|w| w.iter().all(|&x| x == 0)) {
            (0, Vec::new())
        } else {
            hit_on(layout, &t.gpu, &lens, m.cap, m.num_hashed)
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
            let mut media = Vec::new();
            if used > 0 {
                // each used block's medium: GPU if there, else the first other medium (by rank)
                // holding it, else unknown
                let mut left = range_bits(words[k], s, e);
                left.iter_mut().zip(&t.gpu[k]).for_each(|(a, b)| *a &= !b);
                let mut n_left = ones(&left);
                if n_left < used {
                    media.push(GPU_ID);
                }
                let mut others: Vec<&(u16, Vec<u64>)> = t.media[k].iter().collect();
                others.sort_by_key(|(id, _)| {
                    media_rank.get(*id as usize).copied().unwrap_or(u32::MAX)
                });
                for (id, bits) in others {
                    if n_left == 0 {
                        break;
                    }
                    let found: usize = left
                        .iter()
                        .zip(bits)
                        .map(|(a, b)| (a & b).count_ones() as usize)
                        .sum();
                    if found > 0 {
                        media.push(*id as u32);
                        left.iter_mut().zip(bits).for_each(|(a, b)| *a &= !b);
                        n_left -= found;
                    }
                }
                if n_left > 0 {
                    media.push(UNKNOWN);
                }
            }
            per_group.push(GroupOut {
                gpu_blocks,
                blocks: used,
                media,
            });
        }
        out.push(NodeOut {
            member: mi,
            gpu_tokens,
            any_tokens,
            groups: per_group,
        });
    }
    Ok(out)
}
