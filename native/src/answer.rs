//! The answer of the native route decision written as JSON, byte for byte as the Python path's
//! msgspec encoding of `RouteAnswer` (`processors/router/model.py`): the plan holds the parts that
//! do not depend on the prompt as JSON already, this module writes the rest per row.

use std::fmt::Write as _;

use crate::decide::{Live, Plan, Row};
use crate::route;

/// `v` in decimal.
fn push_int(out: &mut String, v: impl itoa::Integer) {
    out.push_str(itoa::Buffer::new().format(v));
}

/// Shortest text that reads back as `x` (what msgspec and Python write, up to exponent style).
fn push_f64(out: &mut String, x: f64) {
    if push_nine_places(out, x) {
        return;
    }
    // JSON has no NaN or infinity; the plan's values are finite (loads are checked at ingest)
    if x == x.trunc() && x.abs() < 1e16 {
        let _ = write!(out, "{x:.1}");
    } else {
        let _ = write!(out, "{x}");
    }
}

/// `x` written from its integer count of 10^-9 where it is the double nearest such a count (every
/// score is, being rounded to 9 places, and so are timings rounded to fewer): that decimal is then
/// `x`'s shortest text, since below 2^22 two doubles a 10^-9 apart never meet. False for any other
/// `x` (and for zeros: -0.0 keeps its sign on the general path). Why: the general float printer
/// was ~5 % of a full answer's time.
fn push_nine_places(out: &mut String, x: f64) -> bool {
    const LIMIT: f64 = (1u64 << 22) as f64;
    if x == 0.0 || !x.is_finite() || x.abs() >= LIMIT {
        return false;
    }
    let k = (x * 1e9).round();
    if k / 1e9 != x {
        return false;
    }
    let k = k as i64;
    if k < 0 {
        out.push('-');
    }
    let k = k.unsigned_abs();
    push_int(out, k / 1_000_000_000);
    out.push('.');
    let frac = k % 1_000_000_000;
    if frac == 0 {
        out.push('0');
        return true;
    }
    let mut digits = itoa::Buffer::new();
    let text = digits.format(frac);
    for _ in text.len()..9 {
        out.push('0');
    }
    out.push_str(text.trim_end_matches('0'));
    true
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn write_answer(
    plan: &Plan,
    live: &[Live],
    shown: &[&Row],
    hash_blocks: &[usize],
    config_nodes: &[usize],
    num_tokens: i64,
    hashing_s: f64,
    search_s: f64,
    now: f64,
    prefixes: bool,
    no_signal: &str,
) -> Vec<u8> {
    let mut o = String::with_capacity(1024 + no_signal.len());
    o.push_str("{\"chosen\":");
    match shown.first() {
        Some(r) => push_str_json(&mut o, &plan.nodes[r.node].id),
        None => o.push_str("null"),
    }
    o.push_str(if prefixes {
        ",\"semantics\":\"prefix-per-group\",\"model\":"
    } else {
        ",\"semantics\":\"hma\",\"model\":"
    });
    o.push_str(&plan.model);
    o.push_str(",\"num_tokens\":");
    push_int(&mut o, num_tokens);
    o.push_str(",\"hash_configs\":[");
    let mut first = true;
    for (i, cfg) in plan.configs.iter().enumerate() {
        let Some(&blocks) = hash_blocks.get(i) else {
            continue;
        };
        if config_nodes[i] == 0 {
            continue;
        }
        if !first {
            o.push(',');
        }
        first = false;
        o.push_str(&cfg.json_head);
        o.push_str("\"hash_blocks\":");
        push_int(&mut o, blocks);
        o.push_str(",\"hashing_s\":");
        push_f64(&mut o, (hashing_s * 1e6).round() / 1e6);
        o.push('}');
    }
    o.push_str("],\"nodes\":[");
    for (i, r) in shown.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        write_row(&mut o, plan, &live[r.node], r, now, prefixes);
    }
    o.push_str("],\"no_signal\":");
    o.push_str(no_signal);
    o.push_str(",\"hashing_s\":");
    push_f64(&mut o, (hashing_s * 1e6).round() / 1e6);
    o.push_str(",\"search_s\":");
    push_f64(&mut o, (search_s * 1e6).round() / 1e6);
    o.push_str(",\"partial\":false,\"missing_partitions\":[]}");
    o.into_bytes()
}

fn write_row(o: &mut String, plan: &Plan, l: &Live, r: &Row, now: f64, prefixes: bool) {
    let node = &plan.nodes[r.node];
    o.push_str(&node.head);
    o.push_str("\"state\":");
    match r.tier {
        2 => {
            o.push_str("\"suspect\",\"state_reason\":");
            o.push_str(l.suspect.as_deref().unwrap_or("null"));
        }
        1 => {
            let (_, bound) = plan.stale_after.as_ref().expect("stale tier needs a bound");
            o.push_str("\"stale\",\"state_reason\":");
            push_str_json(
                o,
                &format!("silent for {:.1} s (bound {bound} s)", now - l.last_seen),
            );
        }
        _ => o.push_str("\"live\",\"state_reason\":null"),
    }
    o.push_str(",\"gpu_tokens\":");
    push_int(o, r.gpu);
    o.push_str(",\"loadable_tokens\":");
    push_int(o, r.loadable);
    o.push_str(",\"groups\":[");
    let model = &r.cohort.models[r.cohort.members.models[r.member] as usize];
    for (k, head) in model.group_heads.iter().enumerate() {
        if k > 0 {
            o.push(',');
        }
        o.push_str(head);
        let group = r.out.as_ref().map(|n| &n.groups[k]);
        let (gpu_blocks, blocks, media) = match group {
            Some(g) => (g.gpu_blocks, g.blocks, g.media),
            None => (0, 0, 0),
        };
        o.push_str("\"gpu_blocks\":");
        push_int(o, gpu_blocks);
        o.push_str(",\"blocks\":");
        push_int(o, blocks);
        o.push_str(",\"medium\":");
        write_media(o, plan, media);
        if prefixes {
            write_prefixes(o, plan, group.and_then(|g| g.prefix.as_ref()));
        }
        o.push('}');
    }
    o.push_str("],\"exact\":true,\"reason\":null,\"score\":");
    push_f64(o, r.score);
    o.push_str(",\"speculative\":false,\"load\":{");
    // the Load struct's fields left out at their defaults, as msgspec writes it
    let mut sep = "";
    if l.running != 0 {
        o.push_str("\"running\":");
        push_int(o, l.running);
        sep = ",";
    }
    if l.waiting != 0 {
        o.push_str(sep);
        o.push_str("\"waiting\":");
        push_int(o, l.waiting);
        sep = ",";
    }
    if l.kv_usage != 0.0 {
        o.push_str(sep);
        o.push_str("\"kv_usage\":");
        push_f64(o, l.kv_usage);
    }
    o.push_str("}}");
}

/// `"prefix_blocks"` as `processors/router/cohort.py: _prefixes` writes it: per medium the node holds
/// in the group, by name, the longest held prefix in blocks, then "any" (a node holding nothing:
/// `{"any":0}`).
fn write_prefixes(o: &mut String, plan: &Plan, prefix: Option<&(Vec<(i64, usize)>, usize)>) {
    o.push_str(",\"prefix_blocks\":{");
    let (mut per, any): (Vec<(&str, usize)>, usize) = match prefix {
        Some((per, any)) => (
            per.iter()
                .map(|&(m, n)| {
                    (
                        if m < 0 {
                            "GPU"
                        } else {
                            plan.media[m as usize].as_str()
                        },
                        n,
                    )
                })
                .collect(),
            *any,
        ),
        None => (Vec::new(), 0),
    };
    per.sort();
    for (name, n) in per {
        push_str_json(o, name);
        o.push(':');
        push_int(o, n);
        o.push(',');
    }
    o.push_str("\"any\":");
    push_int(o, any);
    o.push('}');
}

/// `processors/core/slots.py: NativeStore.media_names`: GPU first, then the others by name, "?" for
/// blocks on no medium known, "none" for none; written as a JSON string.
fn write_media(o: &mut String, plan: &Plan, mask: u64) {
    // the common masks without a list: every row of every answer writes one per group
    match mask {
        0 => return o.push_str("\"none\""),
        route::GPU_BIT => return o.push_str("\"GPU\""),
        _ => {}
    }
    // at most GPU, "?" and one name per medium bit: on the stack (a row writes this per group)
    let mut names = [""; route::MEDIA_BITS as usize + 2];
    let mut n = 0;
    let mut add = |name| {
        names[n] = name;
        n += 1;
    };
    if mask & route::GPU_BIT != 0 {
        add("GPU");
    }
    if mask & route::UNKNOWN_BIT != 0 {
        add("?");
    }
    for (i, m) in plan.media.iter().enumerate() {
        if (i as u32) < route::MEDIA_BITS && mask >> i & 1 == 1 {
            add(m);
        }
    }
    let names = &mut names[..n];
    names.sort_unstable_by(|a, b| (*a != "GPU", *a).cmp(&(*b != "GPU", *b)));
    if names.iter().all(|m| plain(m)) {
        o.push('"');
        for (i, m) in names.iter().enumerate() {
            if i > 0 {
                o.push('+');
            }
            o.push_str(m);
        }
        o.push('"');
    } else {
        push_str_json(o, &names.join("+"));
    }
}

/// Whether `s` is written between quotes as it is (printable ASCII, no quote or backslash).
fn plain(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

/// `s` as a JSON string: as it is between quotes when nothing in it needs escaping (node ids and
/// medium names, in every row), else serde_json's escaping.
pub(crate) fn push_str_json(o: &mut String, s: &str) {
    if plain(s) {
        o.push('"');
        o.push_str(s);
        o.push('"');
    } else {
        o.push_str(&serde_json::to_string(s).expect("a str always encodes"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts of 10^-9, and values near them, written as the general printer writes them.
    #[test]
    fn nine_place_values_are_written_as_their_shortest_text() {
        let mut next = crate::testrng::xorshift(0x0009_ace5);
        let mut fast = 0;
        for i in 0..200_000 {
            let k = (next() % 4_000_000_000_000_000) as i64 - 2_000_000_000_000_000;
            let x = match i % 4 {
                0 => k as f64 / 1e9,
                1 => (k % 3_000_000_000) as f64 / 1e9,
                2 => (k % 1000) as f64 / 1e6,
                _ => f64::from_bits((k as f64 / 1e9).to_bits().wrapping_add(next() % 3)),
            };
            let mut s = String::new();
            if push_nine_places(&mut s, x) {
                fast += 1;
                let want = if x == x.trunc() {
                    format!("{x:.1}")
                } else {
                    format!("{x}")
                };
                assert_eq!(s, want, "{x:e}");
            }
        }
        assert!(fast > 100_000);
    }

    #[test]
    fn floats_read_back() {
        for x in [0.0, -0.0, 1.0, 0.5, 1e-7, 123456.789, -0.045, 1e20] {
            let mut s = String::new();
            push_f64(&mut s, x);
            assert_eq!(s.parse::<f64>().unwrap(), x);
        }
    }
}
