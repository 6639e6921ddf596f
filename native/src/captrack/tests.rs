//! Re-stores of `CapacityCore` on traces whose answer is known by construction (the same traces as
//! tests/unit/test_capacity.py), the stale-dict cases of `stored` with the values restores.py gives,
//! and a measurement of the raw cost per stored hash and per end (ignored: run it by name).

use super::*;

const EVICTED: &str = "evicted";

/// An LRU cache of `capacity` blocks serving `accesses` as vLLM would publish it (a miss stores, a
/// full cache evicts its LRU block first, a hit publishes nothing); returns the re-stores with the
/// time of each.
fn lru_trace(core: &mut CapacityCore, accesses: &[u64], capacity: usize) -> Vec<(Restored, f64)> {
    let mut cache: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    for (t, &h) in accesses.iter().enumerate() {
        let ts = 1000.0 + t as f64;
        if let Some(i) = cache.iter().position(|&c| c == h) {
            cache.remove(i);
            cache.push(h);
            continue;
        }
        if cache.len() == capacity {
            core.end("n1", 0, "GPU", cache.remove(0), ts, EVICTED);
        }
        let mut got = Vec::new();
        core.stored("n1", 0, "GPU", 0, &[h], &mut got);
        out.extend(got.into_iter().map(|r| (r, ts)));
        cache.push(h);
    }
    out
}

#[test]
fn a_cyclic_trace_over_k_blocks_re_stores_each_at_distance_k_minus_1() {
    for (k, capacity) in [(10u64, 4usize), (37, 36), (64, 8)] {
        let mut core = CapacityCore::new(1 << 20);
        let accesses: Vec<u64> = (0..6 * k).map(|i| i % k).collect();
        let rows = lru_trace(&mut core, &accesses, capacity);
        assert_eq!(rows.len() as u64, 5 * k);
        assert_eq!(core.restores(), 5 * k);
        for (r, ts) in &rows {
            assert_eq!((r.distance, r.held), (k - 1, capacity as u64 - 1)); // its own eviction made room
            assert_eq!(
                (ts - r.removed_ts, core.reason(r.reason)),
                ((k as usize - capacity) as f64, EVICTED)
            );
        }
    }
}

#[test]
fn re_stores_equal_an_independent_replay_of_a_random_lru_trace() {
    let mut rng = Rng(7);
    let accesses: Vec<u64> = (0..3000)
        .map(|_| {
            if rng.below(10) < 7 {
                rng.below(30)
            } else {
                rng.below(200)
            }
        })
        .collect();
    let mut core = CapacityCore::new(1 << 20);
    let rows = lru_trace(&mut core, &accesses, 20);
    // the model: every miss is a store; a re-store is a miss of a hash stored and evicted before, its
    // distance the distinct stores since that hash's previous store
    let (mut cache, mut stores, mut removed_at, mut want) = (
        Vec::new(),
        Vec::new(),
        HashMap::<u64, f64>::default(),
        Vec::new(),
    );
    for (t, &h) in accesses.iter().enumerate() {
        if let Some(i) = cache.iter().position(|&c| c == h) {
            cache.remove(i);
            cache.push(h);
            continue;
        }
        if cache.len() == 20 {
            removed_at.insert(cache.remove(0), 1000.0 + t as f64);
        }
        if let Some(removed) = removed_at.remove(&h) {
            let last = stores.iter().rposition(|&s| s == h).unwrap();
            let since: std::collections::HashSet<u64> =
                stores[last + 1..].iter().copied().collect();
            want.push((h, since.len() as u64, 1000.0 + t as f64 - removed));
        }
        stores.push(h);
        cache.push(h);
    }
    let got: Vec<_> = rows
        .iter()
        .map(|(r, ts)| (r.hash, r.distance, ts - r.removed_ts))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn an_end_then_a_store_is_a_re_store_and_a_store_of_a_held_hash_is_not() {
    let mut core = CapacityCore::new(1 << 20);
    let mut out = Vec::new();
    core.stored("n1", 0, "GPU", 0, &[1, 2], &mut out);
    core.end("n1", 0, "GPU", 1, 11.0, EVICTED);
    core.stored("n1", 0, "GPU", 0, &[3, 1], &mut out);
    core.stored("n1", 0, "GPU", 0, &[2], &mut out); // a copy of a held hash
    core.end("n1", 0, "GPU", 2, 12.0, EVICTED);
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].hash, out[0].distance, out[0].removed_ts, out[0].held),
        (1, 2, 11.0, 2)
    );
    // other slots, nodes and media are apart; an end in a slot never stored changes nothing
    core.end("n2", 0, "GPU", 2, 13.0, EVICTED);
    core.end("n1", 1, "GPU", 2, 13.0, EVICTED);
    core.end("n1", 0, "CPU", 2, 13.0, EVICTED);
    core.stored("n1", 0, "CPU", 0, &[2], &mut out);
    assert_eq!(out.len(), 1);
    core.stored("n1", 0, "GPU", 0, &[2], &mut out);
    assert_eq!((out.len(), out[1].hash, out[1].removed_ts), (2, 2, 12.0));
    assert_eq!(core.slot_count(), 2);
}

/// A slot of max_keys 2 holding [1, 2, 3] (1's lifetime ended at 5.0), compacting at the next store
/// but one; one BlockStored of `hashes`. Returns (rows as (hash, distance, held), held after, order).
fn stale_case(hashes: &[u64]) -> (Vec<(u64, u64, u64)>, u64, Vec<u64>) {
    let mut core = CapacityCore::new(2);
    let ended = [(1, 5.0, EVICTED)];
    core.install_slot("n", 0, "GPU", 0, &[1, 2, 3], 1, &ended, 3, None)
        .unwrap();
    let mut out = Vec::new();
    core.stored("n", 0, "GPU", 0, hashes, &mut out);
    let slot = core.slot("n", 0, "GPU").unwrap();
    (
        out.iter().map(|r| (r.hash, r.distance, r.held)).collect(),
        slot.held,
        slot.order(),
    )
}

#[test]
fn a_compaction_inside_an_event_leaves_fresh_and_ends_as_restores_py_sees_them() {
    // the values restores.py gives for the same slot and event (its `_stored`, stackdist.py)
    // 7 twice after the compaction: both told fresh against the keys before it
    assert_eq!(stale_case(&[9, 7, 7]), (vec![], 6, vec![3, 9, 7]));
    // 1 forgotten by the compaction at 8: no distance, but its end still counts for held
    assert_eq!(stale_case(&[9, 8, 1]), (vec![], 6, vec![3, 9, 8, 1]));
    assert_eq!(stale_case(&[9, 1, 1]), (vec![], 5, vec![3, 9, 1]));
    assert_eq!(stale_case(&[1, 9, 1]), (vec![(1, 2, 3)], 5, vec![3, 9, 1]));
    assert_eq!(stale_case(&[3, 9, 1, 3]), (vec![], 5, vec![2, 9, 1, 3]));
}

#[test]
fn forget_partition_drops_its_slots_and_counts_and_install_replaces_a_slot() {
    let mut core = CapacityCore::new(1 << 20);
    let mut out = Vec::new();
    core.stored("a", 0, "GPU", 0, &[1], &mut out);
    core.stored("b", 0, "GPU", 1, &[1], &mut out);
    assert!(core.cpu_message("a", 1, 0));
    core.cpu_add("a", 0, &[1], 1);
    core.forget_partition(0);
    assert_eq!(core.slots().map(|s| s.node).collect::<Vec<_>>(), vec!["b"]);
    assert!(!core.cpu_message("a", 1, 0) && core.cpu_unknown() == vec![0]);
    let ended = [(4, 2.0, "cleared"), (9, 2.0, EVICTED)];
    core.install_slot("b", 0, "GPU", 1, &[4, 5], 3, &ended, 1, Some(8))
        .unwrap();
    let slot = core.slot("b", 0, "GPU").unwrap();
    assert_eq!((slot.order(), slot.room(), slot.held), (vec![4, 5], 3, 1));
    assert_eq!(slot.ended(), vec![(4, 2.0, "cleared")]); // 9: not in the stack, moves nothing
    core.cpu_install_node("a", 1, 0);
    core.cpu_install_counts("a", 0, &[1, 2], &[2, 0]);
    core.cpu_known(0);
    assert!(
        core.cpu_message("a", 1, 0)
            && core.cpu_gpu_store("a", 0, &[1, 2]) == 1
            && core.cpu_entries() == 1
    );
}

/// The raw cost per stored hash and per end, on a workload shaped like the bench's (stores of 12 hashes,
/// most new, a third of the ended hashes stored again; 11 of each store's hashes end after it): `slots`
/// nodes' GPU slots, `stores` stores. Returns (ns per stored hash, ns per end, re-stores).
fn cost_of(slots: usize, stores: u64, max_keys: usize) -> (f64, f64, u64) {
    let mut rng = Rng(1);
    let (mut core, mut out) = (CapacityCore::new(max_keys), Vec::new());
    let nodes: Vec<String> = (0..slots).map(|i| format!("node-{i}")).collect();
    let mut ended: Vec<Vec<u64>> = vec![Vec::new(); slots];
    let (mut next, mut hashes) = (0u64, Vec::new());
    let (mut store_s, mut end_s) = (0.0, 0.0);
    for step in 0..stores {
        let n = rng.below(slots as u64) as usize;
        hashes.clear();
        for _ in 0..12 {
            let back = &mut ended[n];
            if !back.is_empty() && rng.below(3) == 0 {
                let i = rng.below(back.len() as u64) as usize;
                hashes.push(back.swap_remove(i));
            } else {
                next += 1;
                hashes.push(next.wrapping_mul(0x9E3779B97F4A7C15));
            }
        }
        let t = std::time::Instant::now();
        core.stored(&nodes[n], 0, "GPU", 0, &hashes, &mut out);
        store_s += t.elapsed().as_secs_f64();
        out.clear();
        let t = std::time::Instant::now();
        for &h in &hashes[..11] {
            core.end(&nodes[n], 0, "GPU", h, step as f64, EVICTED);
        }
        end_s += t.elapsed().as_secs_f64();
        ended[n].extend_from_slice(&hashes[..11]);
    }
    (
        1e9 * store_s / (12 * stores) as f64,
        1e9 * end_s / (11 * stores) as f64,
        core.restores(),
    )
}

/// Run with `cargo test --release --lib captrack::tests::cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn cost() {
    for (what, slots, stores, max_keys) in [
        ("bench-sized: 32 slots, 13k stores", 32, 13_000, 1 << 20),
        (
            "4.8 M stores into 8 slots, no bound reached",
            8,
            400_000,
            1 << 20,
        ),
        (
            "4.8 M stores into 8 slots of max_keys 2^16",
            8,
            400_000,
            1 << 16,
        ),
    ] {
        cost_of(slots, stores, max_keys); // warm the allocator's pages
        let (store_ns, end_ns, restores) = cost_of(slots, stores, max_keys);
        println!("{what}: {store_ns:.1} ns per stored hash, {end_ns:.1} ns per end ({restores} re-stores)");
    }
}
