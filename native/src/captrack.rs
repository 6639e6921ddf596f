//! The analytics app's capacity tracker: the rules of processors/analytics/restores.py
//! (`RestoreTracker`: re-stores, their stack distance, the end before them, the slot's held blocks)
//! and processors/analytics/cputier.py (`CpuTier`: the CPU tier's copies behind `from_cpu_blocks`),
//! with the same outputs for the same calls. Pure Rust: a native ingest run calls it per message and
//! event; Python reaches it through `pycaptrack` (processors/analytics/nativetrack.py), and
//! tests/property/test_native_capacity_tracker.py holds it equal to the Python classes.
//!
//! Layout: per node (looked up by `&str`, no allocation per call) its few slots, scanned by (group,
//! medium id); media and end reasons interned as small ids (a handful of each exists). Each slot's
//! stack (`stack`) keeps the end of a hash's last lifetime in the hash's own entry, so a store is one
//! probe for its distance and its end.
//!
//! What Python does that is kept on purpose, since it moves outputs:
//! - `held` is the slot's count, moved by stores (a fresh hash or one whose lifetime ended) and ends,
//!   never below 0, and per slot as restores.py keeps it (a slot keeps the partition it was made in);
//! - the stale dict of `_stored` (see `stored`).

mod cpu;
mod stack;

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use stack::Stack;
pub use stack::NO_END;

/// One re-store: the stored hash, its previous lifetime's end (`reason`: an id for `reason()`), its LRU
/// stack distance among the slot's stores, and the blocks the slot held just before it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Restored {
    pub hash: u64,
    pub removed_ts: f64,
    pub reason: u32,
    pub distance: u64,
    pub held: u64,
}

/// Per hash left in a `stored` call at its first compaction: whether the stack held it then, and its end.
type Before = HashMap<u64, (bool, Option<(f64, u32)>), RandomState>;

/// A node's CPU counts: (node, epoch, partition, [(group, [(hash, copies)])]).
pub type CpuNode<'a> = (&'a str, i64, i64, Vec<(i64, Vec<(u64, i64)>)>);

/// One (node, group, medium) of restores.py (`Slot`).
struct Slot {
    group: i64,
    medium: u32,
    partition: i64,
    held: u64,
    stack: Stack,
}

/// A slot as introspection shows it (`CapacityCore::slots`).
pub struct SlotView<'a> {
    pub node: &'a str,
    pub group: i64,
    pub medium: &'a str,
    pub partition: i64,
    pub held: u64,
    stack: &'a Stack,
    reasons: &'a [String],
}

impl SlotView<'_> {
    /// The remembered hashes, least recently stored first (stackdist.py `order`).
    pub fn order(&self) -> Vec<u64> {
        self.stack.order()
    }

    /// Stores before the stack next compacts (stackdist.py `room`).
    pub fn room(&self) -> usize {
        self.stack.room()
    }

    pub fn len(&self) -> usize {
        self.stack.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stack.len() == 0
    }

    pub fn forgotten(&self) -> u64 {
        self.stack.forgotten()
    }

    /// The remembered hashes whose last lifetime ended: (hash, removed_ts, reason), in no order.
    pub fn ended(&self) -> Vec<(u64, f64, &str)> {
        let reasons = self.reasons;
        self.stack
            .keys()
            .iter()
            .filter(|(_, e)| e.reason != NO_END)
            .map(|(&h, e)| (h, e.removed_ts, reasons[e.reason as usize].as_str()))
            .collect()
    }
}

pub struct CapacityCore {
    max_keys: usize,
    restores: u64,
    nodes: HashMap<String, Vec<Slot>, RandomState>,
    media: Vec<String>,
    reasons: Vec<String>,
    cpu: cpu::CpuTier,
}

/// The id of `s` in a short list of names, added when new.
fn intern(names: &mut Vec<String>, s: &str) -> u32 {
    match names.iter().position(|n| n == s) {
        Some(i) => i as u32,
        None => {
            names.push(s.to_owned());
            (names.len() - 1) as u32
        }
    }
}

impl CapacityCore {
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys,
            restores: 0,
            nodes: HashMap::default(),
            media: Vec::new(),
            reasons: Vec::new(),
            cpu: cpu::CpuTier::default(),
        }
    }

    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Re-stores found so far (RestoreTracker.restores).
    pub fn restores(&self) -> u64 {
        self.restores
    }

    /// An interned end reason.
    pub fn reason(&self, id: u32) -> &str {
        &self.reasons[id as usize]
    }

    /// The id of an end reason (interned when new): what `Restored::reason` holds for it.
    pub fn reason_id(&mut self, reason: &str) -> u32 {
        intern(&mut self.reasons, reason)
    }

    /// RestoreTracker._end for one ended lifetime: slot (node, group, medium) as the lifetime row has them
    pub fn end(
        &mut self,
        node: &str,
        group: i64,
        medium: &str,
        hash: u64,
        removed_ts: f64,
        end_reason: &str,
    ) {
        let Some(m) = self.media.iter().position(|x| x == medium) else {
            return; // no slot has this medium: never stored here, nothing to come back to
        };
        let Some(slot) = self.nodes.get_mut(node).and_then(|slots| {
            slots
                .iter_mut()
                .find(|s| s.group == group && s.medium == m as u32)
        }) else {
            return;
        };
        // only a hash the stack remembers can come back with a distance (restores.py `_end`)
        if let Some(e) = slot.stack.entry_mut(hash) {
            e.reason = intern(&mut self.reasons, end_reason);
            e.removed_ts = removed_ts;
        }
        slot.held = slot.held.saturating_sub(1);
    }

    /// RestoreTracker._stored for one BlockStored: group = `ev.group_idx or 0`, medium = `ev.medium or "GPU"`
    /// (the caller maps them); pushes one Restored per re-store, in hash order, and counts them in restores()
    pub fn stored(
        &mut self,
        node: &str,
        group: i64,
        medium: &str,
        partition: i64,
        hashes: &[u64],
        out: &mut Vec<Restored>,
    ) {
        let m = intern(&mut self.media, medium);
        let max_keys = self.max_keys;
        let slots = self.nodes.entry_ref(node).or_default();
        let i = match slots.iter().position(|s| s.group == group && s.medium == m) {
            Some(i) => i,
            None => {
                let stack = Stack::new(max_keys);
                slots.push(Slot {
                    group,
                    medium: m,
                    partition,
                    held: 0,
                    stack,
                });
                slots.len() - 1
            }
        };
        let slot = &mut slots[i];
        let first = out.len();
        // `_stored` reads the stack's dict once, before its loop, to tell a fresh hash; a compaction inside
        // the loop replaces that dict (stackdist.py `_install`), so the event's later hashes are told fresh
        // against the keys as they were just before it, and an end `ended` still holds for a hash that
        // compaction forgot counts for `held`. `before`: for the hashes left at the first compaction, whether
        // the stack held them then and their end (taken as `ended.pop` takes it). `held` differs without it.
        let mut before: Option<Before> = None;
        for (k, &h) in hashes.iter().enumerate() {
            if slot.stack.full() {
                if before.is_none() {
                    let keys = slot.stack.keys();
                    let seen = |h: &u64| match keys.get(h) {
                        Some(&e) => (true, { e }.take_end()),
                        None => (false, None),
                    };
                    before = Some(hashes[k..].iter().map(|h| (*h, seen(h))).collect());
                }
                slot.stack.compact();
            }
            let (distance, mut end) = slot.stack.access(h);
            // fresh: not in the stack before this access, which a distance tells unless a compaction came between
            let fresh = match before
                .as_mut()
                .map(|b| b.get_mut(&h).expect("every hash left is in `before`"))
            {
                Some((known, was_end)) => {
                    end = end.or(was_end.take());
                    !*known
                }
                None => distance.is_none(),
            };
            if let (Some((removed_ts, reason)), Some(distance)) = (end, distance) {
                out.push(Restored {
                    hash: h,
                    removed_ts,
                    reason,
                    distance,
                    held: slot.held,
                });
            }
            if fresh || end.is_some() {
                slot.held += 1;
            }
        }
        self.restores += (out.len() - first) as u64;
    }

    // CpuTier.observe split per message / per event:

    /// start of an applied message of `node`: false if the partition's counts are unknown (every event then gets None);
    /// else the node's copies are reset when its epoch changed, and its partition recorded
    pub fn cpu_message(&mut self, node: &str, epoch: i64, partition: i64) -> bool {
        self.cpu.message(node, epoch, partition)
    }

    /// a GPU BlockStored: how many of its hashes have a live CPU copy (group: -1 for None)
    pub fn cpu_gpu_store(&self, node: &str, group: i64, hashes: &[u64]) -> u32 {
        self.cpu.gpu_store(node, group, hashes)
    }

    /// a CPU BlockStored (+1) or CPU BlockRemoved (-1)
    pub fn cpu_add(&mut self, node: &str, group: i64, hashes: &[u64], step: i64) {
        self.cpu.add(node, group, hashes, step)
    }

    /// Drop one events partition's state, both parts (CapacityTracker.forget_partition): its slots, and its
    /// nodes' CPU counts, that partition's events counting None until `cpu_known`.
    pub fn forget_partition(&mut self, partition: i64) {
        self.forget_slots(|s| s.partition == partition);
        self.cpu.forget_partition(partition);
    }

    /// The restore part only, for one node (RestoreTracker.forget_node).
    pub fn forget_node(&mut self, node: &str) {
        self.nodes.remove(node);
    }

    fn forget_slots(&mut self, gone: impl Fn(&Slot) -> bool) {
        self.nodes.retain(|_, slots| {
            slots.retain(|s| !gone(s));
            !slots.is_empty()
        });
    }

    /// Put one slot rebuilt elsewhere in place of any slot of that key (RestoreTracker.install, one entry of
    /// its `slots`): its stack's keys oldest first and room (see `stack::Stack::install`), the ends of
    /// its hashes (those the stack does not hold are dropped: they move no output), its held blocks, and
    /// its stack's bound (a Python `Slot` keeps the one it was made with; None: the tracker's).
    #[allow(clippy::too_many_arguments)]
    pub fn install_slot(
        &mut self,
        node: &str,
        group: i64,
        medium: &str,
        partition: i64,
        keys: &[u64],
        room: usize,
        ended: &[(u64, f64, &str)],
        held: u64,
        max_keys: Option<usize>,
    ) -> Result<(), String> {
        let mut stack = Stack::install(max_keys.unwrap_or(self.max_keys), keys, room)
            .map_err(|e| format!("slot ({node:?}, {group}, {medium:?}): {e}"))?;
        for &(h, removed_ts, reason) in ended {
            if let Some(e) = stack.entry_mut(h) {
                e.reason = intern(&mut self.reasons, reason);
                e.removed_ts = removed_ts;
            }
        }
        let m = intern(&mut self.media, medium);
        let slots = self.nodes.entry_ref(node).or_default();
        slots.retain(|s| !(s.group == group && s.medium == m));
        slots.push(Slot {
            group,
            medium: m,
            partition,
            held,
            stack,
        });
        Ok(())
    }

    /// One node's CPU counts rebuilt elsewhere (one entry of CpuTier.install's `nodes`), replacing what the
    /// node had: then `cpu_install_counts` per group, and `cpu_known` for the partition installed.
    pub fn cpu_install_node(&mut self, node: &str, epoch: i64, partition: i64) {
        self.cpu.install_node(node, epoch, partition);
    }

    /// One group's counts of a node `cpu_install_node` installed (copies of 0 are no entry).
    pub fn cpu_install_counts(&mut self, node: &str, group: i64, hashes: &[u64], copies: &[i64]) {
        if let Some(n) = self.cpu.nodes.get_mut(node) {
            cpu::CpuTier::install_counts(n, group, hashes, copies);
        }
    }

    /// The partition's CPU counts are complete again (CpuTier.install's end).
    pub fn cpu_known(&mut self, partition: i64) {
        self.cpu.unknown.remove(&partition);
    }

    /// The CPU part's forget only (CpuTier.forget_partition).
    pub fn cpu_forget_partition(&mut self, partition: i64) {
        self.cpu.forget_partition(partition);
    }

    // -- introspection -------------------------------------------------------------------------

    pub fn slot_count(&self) -> usize {
        self.nodes.values().map(Vec::len).sum()
    }

    /// Hashes the stacks remember, over all slots.
    pub fn hashes(&self) -> usize {
        self.nodes.values().flatten().map(|s| s.stack.len()).sum()
    }

    pub fn slots(&self) -> impl Iterator<Item = SlotView<'_>> {
        self.nodes
            .iter()
            .flat_map(move |(node, slots)| slots.iter().map(move |s| self.view(node, s)))
    }

    pub fn slot(&self, node: &str, group: i64, medium: &str) -> Option<SlotView<'_>> {
        let m = self.media.iter().position(|x| x == medium)? as u32;
        let (node, slots) = self.nodes.get_key_value(node)?;
        let s = slots.iter().find(|s| s.group == group && s.medium == m)?;
        Some(self.view(node, s))
    }

    fn view<'a>(&'a self, node: &'a str, s: &'a Slot) -> SlotView<'a> {
        SlotView {
            node,
            group: s.group,
            medium: &self.media[s.medium as usize],
            partition: s.partition,
            held: s.held,
            stack: &s.stack,
            reasons: &self.reasons,
        }
    }

    /// CPU-tier counts held (CpuTier.entries).
    pub fn cpu_entries(&self) -> usize {
        self.cpu.entries()
    }

    /// Partitions whose CPU counts are unknown (CpuTier.unknown), sorted.
    pub fn cpu_unknown(&self) -> Vec<i64> {
        let mut out: Vec<i64> = self.cpu.unknown.iter().copied().collect();
        out.sort_unstable();
        out
    }

    /// Each node's CPU counts.
    pub fn cpu_nodes(&self) -> Vec<CpuNode<'_>> {
        self.cpu
            .nodes
            .iter()
            .map(|(name, n)| {
                let groups = n
                    .groups
                    .iter()
                    .map(|(g, c)| (*g, c.iter().map(|(&h, &k)| (h, k)).collect()))
                    .collect();
                (name.as_str(), n.epoch, n.partition, groups)
            })
            .collect()
    }
}

/// A small deterministic generator for the tests (no dependency).
#[cfg(test)]
pub(crate) struct Rng(pub u64);

#[cfg(test)]
impl Rng {
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

#[cfg(test)]
mod tests;
