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
    // JSON has no NaN or infinity; the plan's values are finite (loads are checked at ingest)
    if x == x.trunc() && x.abs() < 1e16 {
        let _ = write!(out, "{x:.1}");
    } else {
        let _ = write!(out, "{x}");
    }
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

    #[test]
    fn floats_read_back() {
        for x in [0.0, -0.0, 1.0, 0.5, 1e-7, 123456.789, -0.045, 1e20] {
            let mut s = String::new();
            push_f64(&mut s, x);
            assert_eq!(s.parse::<f64>().unwrap(), x);
        }
    }
}
