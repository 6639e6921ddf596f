//! The index's block storage: which slot (one node's group on one medium) holds which block, with
//! the store time of its first copy and the count of extra copies, plus the inverted view per group
//! (block → slots) that routes read. The rules around it (epochs, sequence numbers, expiry, caps,
//! lifetimes' reasons) stay in `processors/core/index.py`; this holds the per-block state, which is
//! what costs memory and time at a million entries.
//!
//! Layout, chosen for memory (each line is per (block × holder) entry unless said):
//! - per slot, an open-addressing table of `(key u64, stored_ts f64)`: 16 B + 1 control byte;
//! - per group, an open-addressing table of `(key u64, holder u32)` packed to 12 B + 1 control
//!   byte per *distinct* block; a block held by several slots keeps its holders in a spill vector
//!   (`holder` then has the top bit set and indexes the spills), so the common single holder
//!   costs no allocation;
//! - extra copies (vLLM does not de-duplicate identical blocks) in one side table keyed by
//!   (slot, key), empty in the common case.
//!
//! Keys are vLLM's 64-bit block hashes (`processors/analytics/rows.py: hash_to_u64`). The tables
//! hash them again with a per-process random seed (foldhash): keys come from the network, and a
//! fixed hash would let a hostile node pile every key into one probe sequence.

use foldhash::fast::RandomState;
use hashbrown::{HashMap, HashTable};
use std::hash::BuildHasher;

/// Marks a holder field that indexes `spills` instead of naming one slot.
const SPILL: u32 = 1 << 31;

#[derive(Clone, Copy)]
#[repr(C, packed(4))]
struct Holder {
    key: u64,
    v: u32,
}

#[derive(Clone, Copy)]
struct Block {
    key: u64,
    ts: f64,
}

struct Slot {
    group: u64,
    meta: SlotMeta,
    live: bool,
    extra: u32, // entries of this slot in `dups` (so closing a slot skips that table when 0)
    blocks: HashTable<Block>,
}

/// Who a slot belongs to, for queries over all nodes at once: the owner's key and the medium
/// (an id the caller assigns; `gpu` marks the GPU medium).
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct SlotMeta {
    pub owner: u32,
    pub medium: u16,
    pub gpu: bool,
}

/// What one `remove` did: copies removed, removals of blocks never stored, and the entries whose
/// last copy went (their lifetimes end), as key and store time.
#[derive(Default)]
pub struct Removed {
    pub removed: usize,
    pub unknown: usize,
    pub keys: Vec<u64>,
    pub ts: Vec<f64>,
}

pub struct Store {
    rs: RandomState,
    slots: Vec<Slot>,
    free: Vec<u32>,
    groups: HashMap<u64, HashTable<Holder>, RandomState>,
    spills: Vec<Vec<u32>>,
    free_spills: Vec<u32>,
    dups: HashMap<(u32, u64), u32, RandomState>,
    entries: usize,
    serial: u64,
    slot_version: u64,
}

/// Tells stores apart (a cache built on one store is never used with another).
static SERIALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

/// Asks the core to load the cache line at `p` (a hint: never faults, whatever `p` is).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that does not access memory architecturally; any address is allowed.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[inline]
fn hkey(rs: &RandomState, key: u64) -> u64 {
    rs.hash_one(key)
}

/// One live slot and everything its entries touch, borrowed apart: the slot, its group's inverted
/// table, the spills, the copies table, the entry count and the free slot ids.
struct Parts<'a> {
    rs: &'a RandomState,
    slot: &'a mut Slot,
    table: &'a mut HashTable<Holder>,
    spills: &'a mut Vec<Vec<u32>>,
    free_spills: &'a mut Vec<u32>,
    dups: &'a mut HashMap<(u32, u64), u32, RandomState>,
    entries: &'a mut usize,
    free: &'a mut Vec<u32>,
}

impl Store {
    fn parts(&mut self, id: u32) -> Result<Parts<'_>, String> {
        let Store {
            rs,
            slots,
            free,
            groups,
            spills,
            free_spills,
            dups,
            entries,
            ..
        } = self;
        let slot = match slots.get_mut(id as usize) {
            Some(s) if s.live => s,
            _ => return Err(format!("no live slot {id}")),
        };
        let table = groups
            .get_mut(&slot.group)
            .expect("group table made with the slot");
        Ok(Parts {
            rs,
            slot,
            table,
            spills,
            free_spills,
            dups,
            entries,
            free,
        })
    }

    pub fn new() -> Self {
        Store {
            rs: RandomState::default(),
            slots: Vec::new(),
            free: Vec::new(),
            groups: HashMap::with_hasher(RandomState::default()),
            spills: Vec::new(),
            free_spills: Vec::new(),
            dups: HashMap::with_hasher(RandomState::default()),
            entries: 0,
            serial: SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            slot_version: 0,
        }
    }

    /// This store's identity among the process's stores.
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Changes whenever a slot is opened or closed (what caches of slot metadata key on).
    pub fn slot_version(&self) -> u64 {
        self.slot_version
    }

    /// A new empty slot of `group`; ids of closed slots are reused.
    pub fn new_slot(&mut self, group: u64, meta: SlotMeta) -> Result<u32, String> {
        let slot = Slot {
            group,
            meta,
            live: true,
            extra: 0,
            blocks: HashTable::new(),
        };
        self.groups.entry(group).or_default();
        self.slot_version += 1;
        if let Some(id) = self.free.pop() {
            self.slots[id as usize] = slot;
            return Ok(id);
        }
        if self.slots.len() as u64 >= SPILL as u64 {
            return Err("more than 2^31 slots".into());
        }
        self.slots.push(slot);
        Ok((self.slots.len() - 1) as u32)
    }

    fn slot(&self, id: u32) -> Result<&Slot, String> {
        match self.slots.get(id as usize) {
            Some(s) if s.live => Ok(s),
            _ => Err(format!("no live slot {id}")),
        }
    }

    pub fn len(&self, id: u32) -> Result<usize, String> {
        Ok(self.slot(id)?.blocks.len())
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    pub fn entries(&self) -> usize {
        self.entries
    }

    pub fn get(&self, id: u32, key: u64) -> Result<Option<f64>, String> {
        let rs = &self.rs;
        Ok(self
            .slot(id)?
            .blocks
            .find(hkey(rs, key), |b| b.key == key)
            .map(|b| b.ts))
    }

    pub fn copies(&self, id: u32, key: u64) -> Result<u32, String> {
        Ok(match self.get(id, key)? {
            None => 0,
            Some(_) => 1 + self.dups.get(&(id, key)).copied().unwrap_or(0),
        })
    }

    /// The slot's entries sorted by (store time, key): the order lifetimes and snapshots use.
    pub fn items(&self, id: u32) -> Result<(Vec<u64>, Vec<f64>), String> {
        let mut all: Vec<Block> = self.slot(id)?.blocks.iter().copied().collect();
        sort_blocks(&mut all);
        Ok((
            all.iter().map(|b| b.key).collect(),
            all.iter().map(|b| b.ts).collect(),
        ))
    }

    /// The slot's extra copies, `(key, extra copies)` sorted by key.
    pub fn dup_items(&self, id: u32) -> Result<Vec<(u64, u32)>, String> {
        let s = self.slot(id)?;
        if s.extra == 0 {
            return Ok(Vec::new());
        }
        let mut out: Vec<(u64, u32)> = self
            .dups
            .iter()
            .filter(|((sid, _), _)| *sid == id)
            .map(|((_, k), &n)| (*k, n))
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Store `keys` at `ts`. With a `cap` (blocks per slot) that the store would pass, only the
    /// keys it holds already plus new ones while there is room are kept, judged on the slot
    /// before this call (as `processors/core/index.py: Index._within_cap`). Returns (kept, refused).
    pub fn store(
        &mut self,
        id: u32,
        keys: &[u64],
        ts: f64,
        cap: Option<usize>,
    ) -> Result<(usize, usize), String> {
        let Parts {
            rs,
            slot,
            table,
            spills,
            free_spills,
            dups,
            entries,
            ..
        } = self.parts(id)?;
        let given = keys.len();
        let filtered: Vec<u64>;
        let keys = match cap {
            Some(cap) if slot.blocks.len() + keys.len() > cap => {
                let mut room = cap.saturating_sub(slot.blocks.len());
                filtered = keys
                    .iter()
                    .copied()
                    .filter(|&k| {
                        if slot.blocks.find(hkey(rs, k), |b| b.key == k).is_some() {
                            true
                        } else if room > 0 {
                            room -= 1;
                            true
                        } else {
                            false
                        }
                    })
                    .collect();
                &filtered[..]
            }
            _ => keys,
        };
        for &k in keys {
            let h = hkey(rs, k);
            if slot.blocks.find(h, |b| b.key == k).is_some() {
                *dups.entry((id, k)).or_insert(0) += 1;
                slot.extra += 1;
                continue;
            }
            slot.blocks
                .insert_unique(h, Block { key: k, ts }, |b| hkey(rs, b.key));
            *entries += 1;
            add_holder(table, spills, free_spills, rs, k, id);
        }
        Ok((keys.len(), given - keys.len()))
    }

    /// Remove one copy of each key; the last copy's removal ends the entry.
    pub fn remove(&mut self, id: u32, keys: &[u64]) -> Result<Removed, String> {
        let Parts {
            rs,
            slot,
            table,
            spills,
            free_spills,
            dups,
            entries,
            ..
        } = self.parts(id)?;
        let mut out = Removed::default();
        for &k in keys {
            if slot.extra > 0 {
                if let Some(n) = dups.get_mut(&(id, k)) {
                    if *n > 1 {
                        *n -= 1;
                    } else {
                        dups.remove(&(id, k));
                    }
                    slot.extra -= 1;
                    out.removed += 1;
                    continue;
                }
            }
            match slot.blocks.find_entry(hkey(rs, k), |b| b.key == k) {
                Ok(e) => {
                    let (b, _) = e.remove();
                    *entries -= 1;
                    drop_holder(table, spills, free_spills, rs, k, id);
                    out.removed += 1;
                    out.keys.push(k);
                    out.ts.push(b.ts);
                }
                Err(_) => out.unknown += 1,
            }
        }
        Ok(out)
    }

    /// Drop every entry of the slot (all copies) and free it; returns its entries sorted by
    /// (store time, key).
    pub fn close(&mut self, id: u32) -> Result<(Vec<u64>, Vec<f64>), String> {
        let Parts {
            rs,
            slot,
            table,
            spills,
            free_spills,
            dups,
            entries,
            free,
        } = self.parts(id)?;
        let mut all: Vec<Block> = slot.blocks.drain().collect();
        *entries -= all.len();
        for b in &all {
            drop_holder(table, spills, free_spills, rs, b.key, id);
        }
        if slot.extra > 0 {
            dups.retain(|(sid, _), _| *sid != id);
        }
        slot.live = false;
        slot.extra = 0;
        slot.blocks = HashTable::new();
        free.push(id);
        self.slot_version += 1;
        sort_blocks(&mut all);
        Ok((
            all.iter().map(|b| b.key).collect(),
            all.iter().map(|b| b.ts).collect(),
        ))
    }

    /// Load entries (a snapshot restore): `keys[i]` stored at `ts[i]`, then the extra copies.
    pub fn load(
        &mut self,
        id: u32,
        keys: &[u64],
        ts: &[f64],
        extra: &[(u64, u32)],
    ) -> Result<(), String> {
        if keys.len() != ts.len() {
            return Err("keys and store times differ in length".into());
        }
        let Parts {
            rs,
            slot,
            table,
            spills,
            free_spills,
            dups,
            entries,
            ..
        } = self.parts(id)?;
        // a restore loads a slot in few large pieces: one allocation instead of growing step by step
        slot.blocks.reserve(keys.len(), |b| hkey(rs, b.key));
        for (&k, &t) in keys.iter().zip(ts) {
            let h = hkey(rs, k);
            match slot.blocks.find_mut(h, |b| b.key == k) {
                Some(b) => b.ts = t,
                None => {
                    slot.blocks
                        .insert_unique(h, Block { key: k, ts: t }, |b| hkey(rs, b.key));
                    *entries += 1;
                    add_holder(table, spills, free_spills, rs, k, id);
                }
            }
        }
        for &(k, n) in extra {
            if n == 0 || slot.blocks.find(hkey(rs, k), |b| b.key == k).is_none() {
                continue; // copies of a block not held mean nothing
            }
            let cur = dups.entry((id, k)).or_insert(0);
            slot.extra = slot.extra - *cur + n;
            *cur = n;
        }
        Ok(())
    }

    /// The slots holding `key` in `group`.
    pub fn holders(&self, group: u64, key: u64) -> Vec<u32> {
        let Some(table) = self.groups.get(&group) else {
            return Vec::new();
        };
        match table.find(hkey(&self.rs, key), |x| { x.key } == key) {
            None => Vec::new(),
            Some(x) => {
                let v = x.v;
                if v & SPILL == 0 {
                    vec![v]
                } else {
                    self.spills[(v & !SPILL) as usize].clone()
                }
            }
        }
    }

    /// Whether any slot holds `key` in `group`.
    #[inline]
    pub fn holds_any(&self, group: u64, key: u64) -> bool {
        self.groups
            .get(&group)
            .is_some_and(|t| t.find(hkey(&self.rs, key), |x| { x.key } == key).is_some())
    }

    /// Calls `f(slot, position)` for every (position of `keys`, slot holding it) in `group`.
    ///
    /// In two passes, because each step is a cache miss on a large index: the keys' table entries
    /// first (a short loop, so the core keeps many of these loads in flight at once; with the slots
    /// visited in the same loop, a shared key's ~30 holders filled the core's window and the
    /// misses went one at a time), then the holders, the spill lists a few keys ahead asked for
    /// early (`prefetch`).
    #[inline]
    pub fn for_each_held(&self, group: u64, keys: &[u64], mut f: impl FnMut(u32, usize)) {
        let found = self.found(group, keys);
        for (j, &(i, v)) in found.iter().enumerate() {
            self.prefetch_ahead(&found, j);
            for &s in self.holders_of(&v) {
                f(s, i as usize);
            }
        }
    }

    /// As `for_each_held`, by 64 positions at once: `f(holders, word, mask)` where bit b of `mask`
    /// stands for position `word * 64 + b`, every slot of `holders` holding each of them.
    /// Consecutive positions of one word with the same holders (a prefix that many nodes hold
    /// whole) make one call for their holders instead of one per (position, holder); the union of
    /// the calls' (slot, position) pairs is exactly `for_each_held`'s.
    #[inline]
    pub fn for_each_held_word(
        &self,
        group: u64,
        keys: &[u64],
        mut f: impl FnMut(&[u32], usize, u64),
    ) {
        let found = self.found(group, keys);
        let mut run: Option<(u32, usize, u64)> = None; // (holder field, word, mask)
        for (j, &(i, v)) in found.iter().enumerate() {
            self.prefetch_ahead(&found, j);
            let (word, bit) = (i as usize >> 6, 1u64 << (i & 63));
            if let Some((rv, rw, mask)) = &mut run {
                if *rw == word && (*rv == v || self.holders_of(rv) == self.holders_of(&v)) {
                    *mask |= bit;
                    continue;
                }
                f(self.holders_of(rv), *rw, *mask);
            }
            run = Some((v, word, bit));
        }
        if let Some((rv, rw, mask)) = run {
            f(self.holders_of(&rv), rw, mask);
        }
    }

    /// The (position, holder field) of every key of `keys` that `group` holds, in key order.
    #[inline]
    fn found(&self, group: u64, keys: &[u64]) -> Vec<(u32, u32)> {
        let Some(table) = self.groups.get(&group) else {
            return Vec::new();
        };
        if table.is_empty() {
            return Vec::new();
        }
        let mut found: Vec<(u32, u32)> = Vec::with_capacity(keys.len());
        for (i, &k) in keys.iter().enumerate() {
            if let Some(x) = table.find(hkey(&self.rs, k), |x| { x.key } == k) {
                found.push((i as u32, x.v));
            }
        }
        found
    }

    /// The slots a holder field names: itself, or its spill list.
    #[inline]
    fn holders_of<'a>(&'a self, v: &'a u32) -> &'a [u32] {
        if v & SPILL == 0 {
            std::slice::from_ref(v)
        } else {
            &self.spills[(v & !SPILL) as usize]
        }
    }

    /// Ask early for the spill lists of `found` a few entries past `j`.
    #[inline]
    fn prefetch_ahead(&self, found: &[(u32, u32)], j: usize) {
        const AHEAD: usize = 8;
        if let Some(&(_, w)) = found.get(j + AHEAD) {
            if w & SPILL != 0 {
                prefetch(&self.spills[(w & !SPILL) as usize] as *const Vec<u32> as *const u8);
            }
        }
        if let Some(&(_, w)) = found.get(j + AHEAD / 2) {
            if w & SPILL != 0 {
                let list = &self.spills[(w & !SPILL) as usize];
                let bytes = list.len() * 4;
                let at = list.as_ptr() as *const u8;
                for line in (0..bytes).step_by(64) {
                    prefetch(at.wrapping_add(line));
                }
            }
        }
    }

    /// Slot ids are below this.
    pub fn slot_capacity(&self) -> usize {
        self.slots.len()
    }

    /// The owner and medium of a live slot (None for a closed one).
    #[inline]
    pub fn meta(&self, id: u32) -> Option<SlotMeta> {
        self.slots
            .get(id as usize)
            .filter(|s| s.live)
            .map(|s| s.meta)
    }

    /// Bytes the storage holds on the heap (tables at their allocated size, spills, slot records).
    pub fn memory_bytes(&self) -> usize {
        let mut n = self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.free.capacity() * 4
            + self.free_spills.capacity() * 4
            + self.spills.capacity() * std::mem::size_of::<Vec<u32>>()
            + self.dups.allocation_size()
            + self.groups.allocation_size();
        n += self
            .slots
            .iter()
            .map(|s| s.blocks.allocation_size())
            .sum::<usize>();
        n += self
            .groups
            .values()
            .map(|t| t.allocation_size())
            .sum::<usize>();
        n += self.spills.iter().map(|v| v.capacity() * 4).sum::<usize>();
        n
    }
}

fn sort_blocks(all: &mut [Block]) {
    all.sort_unstable_by(|a, b| a.ts.total_cmp(&b.ts).then(a.key.cmp(&b.key)));
}

fn add_holder(
    table: &mut HashTable<Holder>,
    spills: &mut Vec<Vec<u32>>,
    free_spills: &mut Vec<u32>,
    rs: &RandomState,
    key: u64,
    id: u32,
) {
    let h = hkey(rs, key);
    match table.find_mut(h, |x| { x.key } == key) {
        None => {
            table.insert_unique(h, Holder { key, v: id }, |x| {
                let k = x.key;
                hkey(rs, k)
            });
        }
        Some(x) => {
            let v = x.v;
            if v & SPILL == 0 {
                let pair = vec![v, id];
                let at = match free_spills.pop() {
                    Some(at) => {
                        spills[at as usize] = pair;
                        at
                    }
                    None => {
                        spills.push(pair);
                        (spills.len() - 1) as u32
                    }
                };
                x.v = SPILL | at;
            } else {
                spills[(v & !SPILL) as usize].push(id);
            }
        }
    }
}

fn drop_holder(
    table: &mut HashTable<Holder>,
    spills: &mut [Vec<u32>],
    free_spills: &mut Vec<u32>,
    rs: &RandomState,
    key: u64,
    id: u32,
) {
    let h = hkey(rs, key);
    let Ok(entry) = table.find_entry(h, |x| { x.key } == key) else {
        return;
    };
    let v = entry.get().v;
    if v & SPILL == 0 {
        if v == id {
            entry.remove();
        }
        return;
    }
    let at = (v & !SPILL) as usize;
    let list = &mut spills[at];
    if let Some(p) = list.iter().position(|&s| s == id) {
        list.swap_remove(p);
    }
    if list.len() <= 1 {
        let last = list.first().copied();
        spills[at] = Vec::new();
        free_spills.push(at as u32);
        match last {
            Some(s) => {
                let mut entry = entry;
                entry.get_mut().v = s;
            }
            None => {
                entry.remove();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refcounts_holders_and_close() {
        let mut s = Store::new();
        let a = s.new_slot(0, SlotMeta::default()).unwrap();
        let b = s.new_slot(0, SlotMeta::default()).unwrap();
        assert_eq!(s.store(a, &[1, 2, 2, 3], 1.0, None).unwrap(), (4, 0));
        s.store(b, &[2], 2.0, None).unwrap();
        assert_eq!(s.copies(a, 2).unwrap(), 2);
        let mut h = s.holders(0, 2);
        h.sort();
        assert_eq!(h, vec![a, b]);
        let r = s.remove(a, &[2, 9]).unwrap();
        assert_eq!((r.removed, r.unknown, r.keys.len()), (1, 1, 0));
        let r = s.remove(a, &[2]).unwrap();
        assert_eq!(r.keys, vec![2]);
        assert_eq!(s.holders(0, 2), vec![b]);
        let (keys, _) = s.close(a).unwrap();
        assert_eq!(keys, vec![1, 3]);
        assert_eq!(s.entries(), 1);
        assert!(s.len(a).is_err());
    }

    /// The word walk's calls, spread back to positions, are exactly the position walk's pairs:
    /// slots holding runs of a prefix, some dropping out, spill lists equal in content but not in
    /// index, keys past every word boundary and keys nobody holds.
    #[test]
    fn word_walk_equals_position_walk() {
        let mut rnd = crate::testrng::below(0x5eed_1234_abcd_0001);
        for round in 0..40 {
            let mut s = Store::new();
            let slots: Vec<u32> = (0..1 + rnd(12))
                .map(|_| s.new_slot(0, SlotMeta::default()).unwrap())
                .collect();
            let n = 1 + rnd(300) as usize;
            let keys: Vec<u64> = (0..n as u64).map(|i| 1000 * round + i).collect();
            for &sl in &slots {
                // a prefix of random length, with a few holes
                let end = rnd(n as u64 + 1) as usize;
                let held: Vec<u64> = keys[..end]
                    .iter()
                    .copied()
                    .filter(|_| rnd(10) != 0)
                    .collect();
                s.store(sl, &held, 1.0, None).unwrap();
            }
            let mut ask = keys.clone();
            ask.insert(rnd(n as u64) as usize, 7); // a key nobody holds
            let mut want: Vec<(u32, usize)> = Vec::new();
            s.for_each_held(0, &ask, |sid, i| want.push((sid, i)));
            let mut got: Vec<(u32, usize)> = Vec::new();
            s.for_each_held_word(0, &ask, |holders, word, mask| {
                assert_ne!(mask, 0);
                assert!(!holders.is_empty());
                for &sid in holders {
                    for b in 0..64 {
                        if mask >> b & 1 == 1 {
                            got.push((sid, word * 64 + b));
                        }
                    }
                }
            });
            want.sort();
            got.sort();
            assert_eq!(got, want, "round {round}");
        }
    }
}
