//! The route decision without Python, for the native route server (`serve.rs`): token ids in, the
//! answer `POST /route` gives out, read from the block store while ingest writes it.
//!
//! Python stays the reference and owns every rule that is not per request. It exports a `Plan`
//! whenever the index's nodes change (`processors/router/native.py`: which nodes are eligible, their
//! cohorts, hash configurations, spec models, the parts of the answer that do not depend on the
//! prompt, already as JSON) and the nodes' live state (suspect, last seen, load) every few
//! milliseconds. Per request this module does what `processors/router/decide.py` does on its native
//! cohort path: hash the prompt per configuration (`tokenhash`), search each cohort in one store
//! call (`route::route_cohort`), rank the touched nodes, find the best node holding nothing when it
//! could win, choose, trim to `top_k`, write the JSON.
//!
//! Only the common request is answered here: `token_ids`, or the hash-unit chain (`unit_hashes`
//! with `hash_block_size` and `num_tokens`, every node hashing in that unit), with at most `top_k`
//! and the semantics (`hma` or `prefix-per-group`) beside it, while the plan matches the index's
//! generation, every cohort takes the native path and no in-flight guess exists. Anything else
//! returns None and the server hands the request to the Python app, which answers it as before
//! (its 400s included). `tests/unit/router/test_router_native_route.py` holds both answers equal
//! on seeded fleets, in both prompt forms and both semantics.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::hit::Layout;
use crate::pystore::{read, Shared};
use crate::route::{self, Members, ModelArgs, NodeOut};
use crate::tokenhash;

/// `processors/router/request.py: MAX_TOKENS`; longer prompts get Python's 413.
pub const MAX_TOKENS: usize = 1_000_000;

/// One hash configuration the plan's nodes use (vLLM's default sha256 chain).
pub struct Config {
    pub none_hash: Vec<u8>,
    pub unit: usize,
    /// `{"label":…,"config":{…},"nodes":N,` of its `HashConfigUsed` entry.
    pub json_head: String,
}

/// A spec model of a cohort: its layout in `Plan::layouts`, the list unit per group (tokens per
/// list entry) and per group the head of its `GroupHit` JSON (`{"group_idx":…,"kind":…,"block_size":…,`).
pub struct ModelPlan {
    pub layout: usize,
    pub units: Vec<i64>,
    pub group_heads: Vec<String>,
}

pub struct CohortPlan {
    pub config: usize,
    /// The groups searched, with their block sizes, in the cohort's order.
    pub groups: Vec<(u64, usize)>,
    pub members: Members,
    /// Plan node index per member.
    pub nodes: Vec<usize>,
    pub models: Vec<ModelPlan>,
}

pub struct NodePlan {
    pub id: String,
    /// `{"node_id":…,"epoch":…,"model":…,"dp_rank":…,` of its row.
    pub head: String,
}

pub struct Plan {
    pub generation: u64,
    pub configs: Vec<Config>,
    pub cohorts: Vec<CohortPlan>,
    pub nodes: Vec<NodePlan>,
    /// The answer's `no_signal` array, sorted by node id.
    pub no_signal: String,
    /// The answer's `model` field.
    pub model: String,
    pub layouts: Vec<Layout>,
    pub media_rank: Vec<u32>,
    /// Medium id → name.
    pub media: Vec<String>,
    /// `route_stale_after_s`, and its text as Python prints the float.
    pub stale_after: Option<(f64, String)>,
}

/// A node's state between plans: suspect (with the reason as a JSON string), last seen (its own
/// clock) and its last load report.
#[derive(Clone)]
pub struct Live {
    pub suspect: Option<String>,
    pub last_seen: f64,
    pub running: i64,
    pub waiting: i64,
    pub kv_usage: f64,
    /// The load term of the score, and the score of the node holding nothing (`round(0 - penalty, 9)`):
    /// worked out once per push, not per request (an uncached prompt ranks every node by it).
    pub penalty: f64,
    pub zero_score: f64,
}

impl Live {
    pub fn new(
        suspect: Option<String>,
        last_seen: f64,
        running: i64,
        waiting: i64,
        kv_usage: f64,
    ) -> Self {
        let penalty = RUNNING_W * running as f64 + WAITING_W * (waiting as f64) + KV_W * kv_usage;
        Live {
            suspect,
            last_seen,
            running,
            waiting,
            kv_usage,
            penalty,
            zero_score: round9(0.0 - penalty),
        }
    }
}

/// Scoring's defaults (`processors/router/model.py: Scoring`); a request with its own scoring goes
/// to Python.
const OVERLAP_W: f64 = 1.0;
const CPU_W: f64 = 0.5;
const RUNNING_W: f64 = 0.02;
const WAITING_W: f64 = 0.05;
const KV_W: f64 = 0.5;

pub struct Router {
    store: Shared,
    plan: RwLock<Option<Arc<Plan>>>,
    live: RwLock<Arc<Vec<Live>>>,
    generation: AtomicU64,
    /// False while anything the native path does not model is in force (in-flight guesses, more
    /// than one worker's nodes): every request goes to Python then.
    open: AtomicBool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    #[serde(default)]
    token_ids: Option<Vec<i64>>,
    /// The prompt's hash-unit chain (`processors/router/request.py: _check_units`), as store keys.
    #[serde(default)]
    unit_hashes: Option<Vec<UnitKey>>,
    #[serde(default)]
    hash_block_size: Option<i64>,
    #[serde(default)]
    num_tokens: Option<i64>,
    #[serde(default)]
    top_k: Option<i64>,
    /// "hma" (the default) or "prefix-per-group" (each group's row also says its longest held prefix).
    #[serde(default)]
    semantics: Option<String>,
}

/// `processors/router/request.py: MAX_HASHES`.
pub const MAX_HASHES: usize = 100_000;

/// One hash of a request's chain as the store keys it (`processors/core/slots.py: key_of`): an int
/// (vLLM's external form, `0 <= h < 2**64`) as it is, `"0x…"` bytes by their last 8 bytes read
/// big-endian. Anything else fails the parse, and the request goes to Python, which names the field.
struct UnitKey(u64);

impl<'de> Deserialize<'de> for UnitKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = UnitKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an int in [0, 2**64) or a \"0x…\" hex string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<UnitKey, E> {
                Ok(UnitKey(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<UnitKey, E> {
                hex_key(v)
                    .map(UnitKey)
                    .ok_or_else(|| E::custom("not a clean 0x hex string"))
            }
        }
        d.deserialize_any(Visit)
    }
}

/// The key of `"0x…"` (1 to 64 bytes as plain hex digit pairs; the odd spellings Python's
/// `bytes.fromhex` also takes are left to it).
fn hex_key(v: &str) -> Option<u64> {
    let digits = v
        .strip_prefix("0x")
        .or_else(|| v.strip_prefix("0X"))?
        .as_bytes();
    if digits.is_empty() || digits.len() % 2 != 0 || digits.len() > 128 {
        return None;
    }
    let mut key = 0u64;
    for &c in &digits[digits.len().saturating_sub(16)..] {
        key = key << 4 | (c as char).to_digit(16)? as u64;
    }
    digits.iter().all(u8::is_ascii_hexdigit).then_some(key)
}

/// What a request asks, once checked.
struct Ask {
    prompt: Prompt,
    top_k: Option<i64>,
    /// semantics "prefix-per-group": every group row carries `prefix_blocks`
    prefixes: bool,
}

/// The prompt of a request: token ids to hash, or the chain already hashed.
enum Prompt {
    Tokens(Vec<i64>),
    Units {
        keys: Vec<u64>,
        unit: usize,
        num_tokens: i64,
    },
}

impl Request {
    /// What the request asks when it is one this module answers exactly as Python would; None for
    /// Python to answer (its 400s and 413s say what is wrong).
    fn ask(self) -> Option<Ask> {
        if self.top_k.is_some_and(|k| k < 1) {
            return None;
        }
        let prefixes = match self.semantics.as_deref() {
            None | Some("hma") => false,
            Some("prefix-per-group") => true,
            Some(_) => return None,
        };
        let top_k = self.top_k;
        let prompt = match (self.token_ids, self.unit_hashes) {
            (Some(tokens), None) => {
                let ok = !tokens.is_empty()
                    && tokens.len() <= MAX_TOKENS
                    && self.num_tokens.is_none()
                    && self.hash_block_size.is_none();
                ok.then_some(Prompt::Tokens(tokens))
            }
            (None, Some(units)) => {
                let unit = self.hash_block_size.filter(|&u| u >= 1)?;
                let n = self.num_tokens.filter(|&n| n >= 1)?;
                let ok = units.len() <= MAX_HASHES && units.len() as i64 == n / unit;
                ok.then(|| Prompt::Units {
                    keys: units.into_iter().map(|k| k.0).collect(),
                    unit: unit as usize,
                    num_tokens: n,
                })
            }
            _ => None,
        }?;
        Some(Ask {
            prompt,
            top_k,
            prefixes,
        })
    }
}

/// A candidate row before it is written: its rank key, then what the row needs.
struct Row<'a> {
    tier: u8,
    score: f64,
    gpu: i64,
    loadable: i64,
    node: usize,
    cohort: &'a CohortPlan,
    member: usize,
    out: Option<NodeOut>,
}

impl Router {
    pub fn new(store: Shared) -> Self {
        Router {
            store,
            plan: RwLock::new(None),
            live: RwLock::new(Arc::new(Vec::new())),
            generation: AtomicU64::new(u64::MAX),
            open: AtomicBool::new(false),
        }
    }

    pub fn set_plan(&self, plan: Plan, live: Vec<Live>) {
        *self.live.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(live);
        *self.plan.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(plan));
    }

    pub fn set_live(&self, live: Vec<Live>) {
        *self.live.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(live);
    }

    pub fn set_generation(&self, generation: u64) {
        self.generation.store(generation, Ordering::Release);
    }

    pub fn set_open(&self, open: bool) {
        self.open.store(open, Ordering::Release);
    }

    /// Whether a request would be answered here now (the plan is current and the path open).
    pub fn ready(&self) -> bool {
        self.current().is_some()
    }

    fn current(&self) -> Option<Arc<Plan>> {
        if !self.open.load(Ordering::Acquire) {
            return None;
        }
        let plan = self
            .plan
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        (plan.generation == self.generation.load(Ordering::Acquire)).then_some(plan)
    }

    /// The answer's JSON for `body`, or None for Python to answer.
    pub fn answer(&self, body: &[u8]) -> Option<Vec<u8>> {
        let req: Request = serde_json::from_slice(body).ok()?;
        let ask = req.ask()?;
        let plan = self.current()?;
        let live = self.live.read().unwrap_or_else(|e| e.into_inner()).clone();
        if live.len() != plan.nodes.len() {
            return None;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        decide(&plan, &live, &self.store, &ask, now)
    }
}

/// Python's `round(x, 9)`: the decimal correctly rounded to 9 places, read back.
fn round9(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    format!("{x:.9}").parse().unwrap_or(x)
}

fn tier(l: &Live, now: f64, stale: Option<&(f64, String)>) -> u8 {
    if l.suspect.is_some() {
        2
    } else if stale.is_some_and(|(s, _)| now - l.last_seen > *s) {
        1
    } else {
        0
    }
}

/// Rank order of `decide._rank`: tier, then higher score, more GPU tokens, more loadable tokens,
/// then node id.
fn before(a: &Row, b: &Row, plan: &Plan) -> bool {
    (a.tier, -a.score, -a.gpu, -a.loadable)
        .partial_cmp(&(b.tier, -b.score, -b.gpu, -b.loadable))
        .map(|o| o.then_with(|| plan.nodes[a.node].id.cmp(&plan.nodes[b.node].id)))
        .is_some_and(|o| o == std::cmp::Ordering::Less)
}

fn decide(plan: &Plan, live: &[Live], store: &Shared, ask: &Ask, now: f64) -> Option<Vec<u8>> {
    let (prompt, top_k) = (&ask.prompt, ask.top_k);
    let num_tokens = match prompt {
        Prompt::Tokens(tokens) => tokens.len() as i64,
        Prompt::Units { num_tokens, .. } => *num_tokens,
    };
    let cap = (num_tokens - 1).max(1) as f64;
    let t_hash = Instant::now();
    // per configuration: the chain's 64-bit keys (the digest's last 8 bytes, as the store keys them)
    let mut chains: Vec<Option<Vec<u64>>> = (0..plan.configs.len()).map(|_| None).collect();
    let mut config_nodes = vec![0usize; plan.configs.len()];
    for c in &plan.cohorts {
        if chains[c.config].is_none() {
            let cfg = &plan.configs[c.config];
            chains[c.config] = Some(match prompt {
                Prompt::Tokens(tokens) => {
                    tokenhash::sha256_chain(&cfg.none_hash, tokens, cfg.unit)?
                        .iter()
                        .map(|d| u64::from_be_bytes(d[24..].try_into().expect("32-byte digest")))
                        .collect()
                }
                // nodes hashing in other units are Python's "lists" no-signal entries
                Prompt::Units { keys, unit, .. } if *unit == cfg.unit => keys.clone(),
                Prompt::Units { .. } => return None,
            });
        }
        config_nodes[c.config] += c.members.owners.len();
    }
    let hashing_s = t_hash.elapsed().as_secs_f64();
    // an answer to a chain names no hash configuration and spent no time hashing (`decide.route`)
    let hashed = matches!(prompt, Prompt::Tokens(_));
    let t_search = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut touched_sets: Vec<Vec<bool>> = Vec::with_capacity(plan.cohorts.len());
    {
        let st = read(store);
        for c in &plan.cohorts {
            let chain = chains[c.config].as_ref().expect("hashed above");
            let unit = plan.configs[c.config].unit;
            let lists: Vec<(u64, Vec<u64>)> = c
                .groups
                .iter()
                .map(|&(g, bs)| {
                    let k = bs / unit;
                    (g, chain.iter().skip(k - 1).step_by(k).copied().collect())
                })
                .collect();
            let models: Vec<ModelArgs> = c
                .models
                .iter()
                .map(|m| ModelArgs {
                    layout: m.layout,
                    cap: num_tokens - 1,
                    num_hashed: lists
                        .iter()
                        .zip(&m.units)
                        .map(|((_, l), u)| l.len() as i64 * u)
                        .max()
                        .unwrap_or(0),
                })
                .collect();
            let out = route::route_cohort(
                &st,
                &plan.layouts,
                &lists,
                &c.members,
                &models,
                &plan.media_rank,
                ask.prefixes,
            )
            .ok()?;
            // a medium opened since the plan was exported has no name here yet: Python answers
            let named = (1u64 << plan.media.len().min(route::MEDIA_BITS as usize)) - 1;
            let unnamed = |g: &route::GroupOut| {
                g.media & !(named | route::GPU_BIT | route::UNKNOWN_BIT) != 0
                    || g.prefix.as_ref().is_some_and(|(per, _)| {
                        per.iter().any(|&(m, _)| m >= plan.media.len() as i64)
                    })
            };
            if out.iter().any(|n| n.groups.iter().any(unnamed)) {
                return None;
            }
            let mut touched = vec![false; c.nodes.len()];
            for n in out {
                touched[n.member] = true;
                let node = c.nodes[n.member];
                let l = &live[node];
                let loadable = n.any_tokens - n.gpu_tokens;
                let score = round9(
                    OVERLAP_W * (n.gpu_tokens as f64 + CPU_W * loadable as f64) / cap - l.penalty,
                );
                rows.push(Row {
                    tier: tier(l, now, plan.stale_after.as_ref()),
                    score,
                    gpu: n.gpu_tokens,
                    loadable,
                    node,
                    cohort: c,
                    member: n.member,
                    out: Some(n),
                });
            }
            touched_sets.push(touched);
        }
    }
    // A node holding nothing can win only when no live row with a positive score exists (loads are
    // never negative: the index refuses them; the weights are the defaults).
    if !rows.iter().any(|r| r.score > 0.0 && r.tier == 0) {
        let mut best: Option<Row> = None;
        for (c, touched) in plan.cohorts.iter().zip(&touched_sets) {
            for (m, &node) in c.nodes.iter().enumerate() {
                if touched[m] {
                    continue;
                }
                let l = &live[node];
                let row = Row {
                    tier: tier(l, now, plan.stale_after.as_ref()),
                    score: l.zero_score,
                    gpu: 0,
                    loadable: 0,
                    node,
                    cohort: c,
                    member: m,
                    out: None,
                };
                if best.as_ref().is_none_or(|b| before(&row, b, plan)) {
                    best = Some(row);
                }
            }
        }
        rows.extend(best);
    }
    rows.sort_by(|a, b| {
        if before(a, b, plan) {
            std::cmp::Ordering::Less
        } else if before(b, a, plan) {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    });
    // shown: the chosen (first) row, then rows with a hit, the first `top_k` in all
    let limit = top_k.map(|k| k as usize).unwrap_or(usize::MAX);
    let mut shown: Vec<&Row> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if shown.len() >= limit {
            break;
        }
        if i == 0 || r.gpu > 0 || r.loadable > 0 {
            shown.push(r);
        }
    }
    let search_s = t_search.elapsed().as_secs_f64();
    let (chains, hashing_s) = if hashed {
        (chains, hashing_s)
    } else {
        (Vec::new(), 0.0)
    };
    Some(write_answer(
        plan,
        live,
        &shown,
        &chains,
        &config_nodes,
        num_tokens,
        hashing_s,
        search_s,
        now,
        ask.prefixes,
    ))
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
fn write_answer(
    plan: &Plan,
    live: &[Live],
    shown: &[&Row],
    chains: &[Option<Vec<u64>>],
    config_nodes: &[usize],
    num_tokens: i64,
    hashing_s: f64,
    search_s: f64,
    now: f64,
    prefixes: bool,
) -> Vec<u8> {
    let mut o = String::with_capacity(1024 + plan.no_signal.len());
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
    o.push_str(&num_tokens.to_string());
    o.push_str(",\"hash_configs\":[");
    let mut first = true;
    for (i, cfg) in plan.configs.iter().enumerate() {
        let Some(Some(chain)) = chains.get(i) else {
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
        o.push_str(&chain.len().to_string());
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
    o.push_str(&plan.no_signal);
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
    let _ = write!(o, "{}", r.gpu);
    o.push_str(",\"loadable_tokens\":");
    let _ = write!(o, "{}", r.loadable);
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
        let _ = write!(o, "{gpu_blocks}");
        o.push_str(",\"blocks\":");
        let _ = write!(o, "{blocks}");
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
        let _ = write!(o, "\"running\":{}", l.running);
        sep = ",";
    }
    if l.waiting != 0 {
        let _ = write!(o, "{sep}\"waiting\":{}", l.waiting);
        sep = ",";
    }
    if l.kv_usage != 0.0 {
        let _ = write!(o, "{sep}\"kv_usage\":");
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
        let _ = write!(o, ":{n},");
    }
    let _ = write!(o, "\"any\":{any}}}");
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
    let mut names: Vec<&str> = Vec::new();
    if mask & route::GPU_BIT != 0 {
        names.push("GPU");
    }
    if mask & route::UNKNOWN_BIT != 0 {
        names.push("?");
    }
    for (i, m) in plan.media.iter().enumerate() {
        if (i as u32) < route::MEDIA_BITS && mask >> i & 1 == 1 {
            names.push(m);
        }
    }
    names.sort_by(|a, b| (*a != "GPU", *a).cmp(&(*b != "GPU", *b)));
    push_str_json(o, &names.join("+"));
}

/// `s` as a JSON string: as it is between quotes when nothing in it needs escaping (node ids and
/// medium names, in every row), else serde_json's escaping.
fn push_str_json(o: &mut String, s: &str) {
    if s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
    {
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
    fn round9_matches_python() {
        // values from Python's round(x, 9)
        assert_eq!(round9(0.1234567894999), 0.123456789);
        assert_eq!(round9(-0.02), -0.02);
        assert_eq!(round9(1.0000000005), 1.000000001);
        assert_eq!(round9(0.0), 0.0);
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
