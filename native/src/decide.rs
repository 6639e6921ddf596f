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
//! Only the common request is answered here: `token_ids`, the hash-unit chain (`unit_hashes`
//! with `hash_block_size` and `num_tokens`, every node hashing in that unit), or per-group
//! `block_hashes` with `num_tokens` (see `block_lists`; nodes they do not fit are no-signal rows), with at most `top_k`
//! and the semantics (`hma` or `prefix-per-group`) beside it, while the plan matches the index's
//! generation, every cohort takes the native path and no in-flight guess exists. Anything else
//! returns None and the server hands the request to the Python app, which answers it as before
//! (its 400s included). `tests/unit/router/test_router_native_route.py` holds both answers equal
//! on seeded fleets, in all three prompt forms and both semantics.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::answer::write_answer;
use crate::ask::{Ask, Prompt, Request};
use crate::hashmemo::{self, HashMemo};
use crate::hit::Layout;
use crate::idtext::{IdText, TextStats};
use crate::pystore::{read, Shared};
use crate::reach::Reach;
use crate::route::{self, Members, ModelArgs, NodeOut, Prune};
use crate::topk::{score, Bar, CohortBar};

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
    /// The same entries one by one (node id, entry JSON), for an answer that adds its own.
    pub no_signal_entries: Vec<(String, String)>,
    /// The answer's `model` field.
    pub model: String,
    pub layouts: Vec<Layout>,
    pub media_rank: Vec<u32>,
    /// Medium id → name.
    pub media: Vec<String>,
    /// `route_stale_after_s`, and its text as Python prints the float.
    pub stale_after: Option<(f64, String)>,
    /// Block-hash routes may be answered: no eligible node is left out of the cohorts for its hash
    /// configuration (those routes search such nodes too, and their `no_signal` leaves them out).
    pub block_routes: bool,
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
pub(crate) const OVERLAP_W: f64 = 1.0;
pub(crate) const CPU_W: f64 = 0.5;
const RUNNING_W: f64 = 0.02;
const WAITING_W: f64 = 0.05;
const KV_W: f64 = 0.5;

/// Ids the id-text memo holds per unit the digest memo holds (vLLM's default block: 16 tokens), so
/// both remember prompts of about the same length.
const IDS_PER_UNIT: usize = 16;

pub struct Router {
    store: Shared,
    plan: RwLock<Option<Arc<Plan>>>,
    live: RwLock<Arc<Vec<Live>>>,
    generation: AtomicU64,
    /// False while anything the native path does not model is in force (in-flight guesses, more
    /// than one worker's nodes): every request goes to Python then.
    open: AtomicBool,
    /// Digests of held prefixes' units, so a prefix routed before is not hashed again.
    memo: HashMemo,
    /// The text of held prefixes' token ids, so a prefix routed before is not read digit by digit.
    text: IdText,
}

/// A candidate row before it is written: its rank key, then what the row needs.
pub(crate) struct Row<'a> {
    pub(crate) tier: u8,
    pub(crate) score: f64,
    pub(crate) gpu: i64,
    pub(crate) loadable: i64,
    pub(crate) node: usize,
    pub(crate) cohort: &'a CohortPlan,
    pub(crate) member: usize,
    pub(crate) out: Option<NodeOut>,
}

impl Router {
    /// A router on `store` remembering at most `memo_entries` held units' digests (0: none).
    pub fn new(store: Shared, memo_entries: usize) -> Self {
        Router {
            store,
            plan: RwLock::new(None),
            live: RwLock::new(Arc::new(Vec::new())),
            generation: AtomicU64::new(u64::MAX),
            open: AtomicBool::new(false),
            memo: HashMemo::new(memo_entries),
            text: IdText::new(memo_entries.saturating_mul(IDS_PER_UNIT)),
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
        let req = Request::read(body, Some(&self.text))?;
        let text = req.token_text;
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
        let mut held_ids = 0;
        let answer = decide(
            &plan,
            &live,
            &self.store,
            &self.memo,
            &ask,
            now,
            &mut held_ids,
        )?;
        // the ids of the held prefix past what the memo spelled, remembered as text
        if let (Some(t), Prompt::Tokens(tokens)) = (text, &ask.prompt) {
            let held = held_ids.min(tokens.len());
            if held > t.remembered {
                self.text
                    .admit(&body[t.resume..], &tokens[t.remembered..held]);
            }
        }
        Some(answer)
    }

    pub fn memo_stats(&self) -> hashmemo::MemoStats {
        self.memo.stats()
    }

    pub fn text_stats(&self) -> TextStats {
        self.text.stats()
    }
}

/// Python's `round(x, 9)`: the decimal correctly rounded to 9 places, read back.
pub(crate) fn round9(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    // Fast path, for every touched node's score: below 2^40, x·1e9 is off the exact product by less
    // than 2^-12, so where its fraction is not within 1e-3 of a half it rounds to the same integer k
    // the exact decimal would, and k / 1e9 (both exact) is the double nearest k·10^-9, as Python's
    // reading back gives. Near a half, the decimal text decides (`round9_fast_path_agrees`).
    let y = x * 1e9;
    if y.abs() < (1u64 << 40) as f64 && ((y - y.trunc()).abs() - 0.5).abs() > 1e-3 {
        return y.round() / 1e9;
    }
    format!("{x:.9}").parse().unwrap_or(x)
}

/// A cohort's lists from a block-hash request, as `processors/router/decide.py: _hash_cohorts` makes
/// them for the cohort's layout (`groups`: its groups and block sizes): each group its own list, a
/// group the request does not name the list of the first named group with its block size.
/// `Err(Some(reason))` where the lists do not fit the layout, with the reason
/// `processors/router/request.py: check_group_lists` gives (the cohort's nodes become no-signal
/// rows); `Err(None)` where a group is left without a list (Python's row is "partial", not exact:
/// Python answers).
fn block_lists<'a>(
    given: &'a [(u64, Vec<u64>)],
    groups: &[(u64, usize)],
    num_tokens: i64,
) -> Result<Vec<(u64, &'a [u64])>, Option<String>> {
    let size = |g: u64| groups.iter().find(|&&(h, _)| h == g).map(|&(_, bs)| bs);
    let unknown: Vec<u64> = given
        .iter()
        .map(|&(g, _)| g)
        .filter(|&g| size(g).is_none())
        .collect();
    if !unknown.is_empty() {
        let mut known: Vec<u64> = groups.iter().map(|&(g, _)| g).collect();
        known.sort_unstable();
        return Err(Some(format!(
            "groups {} are not among the node's groups {}",
            py_list(&unknown),
            py_list(&known)
        )));
    }
    for (g, list) in given {
        let bs = size(*g).expect("every given group checked above");
        let want = num_tokens / bs as i64;
        if list.len() as i64 != want {
            return Err(Some(format!(
                "group {g}: {} hashes, expected {want} (num_tokens {num_tokens} // block size {bs}: \
                 one hash per full block of that group)",
                list.len()
            )));
        }
    }
    groups
        .iter()
        .map(|&(g, bs)| {
            let own = given.iter().find(|(h, _)| *h == g);
            let list = own.or_else(|| given.iter().find(|(h, _)| size(*h) == Some(bs)));
            list.map(|(_, l)| (g, &l[..])).ok_or(None)
        })
        .collect()
}

/// A list of ints as Python prints it: `[0, 1]`.
fn py_list(xs: &[u64]) -> String {
    let items: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

pub(crate) fn tier(l: &Live, now: f64, stale: Option<&(f64, String)>) -> u8 {
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

fn decide(
    plan: &Plan,
    live: &[Live],
    store: &Shared,
    memo: &HashMemo,
    ask: &Ask,
    now: f64,
    held_ids: &mut usize,
) -> Option<Vec<u8>> {
    let (prompt, top_k) = (&ask.prompt, ask.top_k);
    let num_tokens = match prompt {
        Prompt::Tokens(tokens) => tokens.len() as i64,
        Prompt::Units { num_tokens, .. } | Prompt::Blocks { num_tokens, .. } => *num_tokens,
    };
    if matches!(prompt, Prompt::Blocks { .. }) && !plan.block_routes {
        return None;
    }
    let cap = (num_tokens - 1).max(1) as f64;
    let t_hash = Instant::now();
    let n = plan.configs.len();
    // per configuration: the chain's 64-bit keys (the digest's last 8 bytes, as the store keys
    // them), up to where `reach.rs` says no node can use more; a request's own chain is borrowed
    let mut chains: Vec<Option<Cow<[u64]>>> = vec![None; n];
    // per configuration, for a token-id prompt: its digests, to remember the held prefix's units
    let mut digests: Vec<Option<hashmemo::Chain>> = (0..n).map(|_| None).collect();
    // per configuration: the prompt's whole units (the answer's `hash_blocks`), 0 where unused
    let mut units = vec![0usize; n];
    let mut config_nodes = vec![0usize; n];
    for c in &plan.cohorts {
        config_nodes[c.config] += c.members.owners.len();
        units[c.config] = match prompt {
            Prompt::Tokens(tokens) => tokens.len() / plan.configs[c.config].unit.max(1),
            // nodes hashing in other units are Python's "lists" no-signal entries
            Prompt::Units { keys, unit, .. } if *unit == plan.configs[c.config].unit => keys.len(),
            Prompt::Units { .. } => return None,
            // the lists are given per group: nothing is hashed
            Prompt::Blocks { .. } => 0,
        };
    }
    let used = |i: usize| plan.cohorts.iter().any(|c| c.config == i);
    // the prefix-per-group semantics reports every group's own prefix: nothing is cut there
    let mut reach: Vec<Option<Reach>> = (0..n)
        .map(|i| {
            (!ask.prefixes && used(i))
                .then(|| Reach::of(plan, i))
                .flatten()
        })
        .collect();
    // Every configuration is hashed before the store is read, so ingest never waits behind the
    // SHA chain. A chain the bound cuts (`reach.rs`) looks its full-attention blocks up under a
    // read lock each; the blocks that ended it are looked up again under the search's lock below,
    // so the cut and the search see one state.
    for i in (0..n).filter(|&i| used(i)) {
        chains[i] = Some(match (prompt, reach[i].as_mut()) {
            (Prompt::Tokens(tokens), Some(r)) => {
                let mut holds = |g, k| read(store).holds_any(g, k);
                let mut more = |u, key| r.more(&mut holds, u, key);
                Cow::Owned(token_chain(
                    tokens,
                    &plan.configs[i],
                    memo,
                    &mut digests[i],
                    &mut more,
                )?)
            }
            (Prompt::Tokens(tokens), None) => Cow::Owned(token_chain(
                tokens,
                &plan.configs[i],
                memo,
                &mut digests[i],
                &mut |_, _| true,
            )?),
            (Prompt::Units { keys, .. }, _) => Cow::Borrowed(&keys[..]),
            (Prompt::Blocks { .. }, _) => Cow::Borrowed(&[][..]),
        });
    }
    let st = read(store);
    for (i, r) in reach.iter_mut().enumerate() {
        let Some(r) = r else { continue };
        match prompt {
            // a few lookups (a bisection): under the search's lock
            Prompt::Units { keys, .. } => {
                if chains[i].is_some() {
                    chains[i] = Some(Cow::Borrowed(&keys[..r.cut(&st, keys)]));
                }
            }
            // a block that ended the chain was stored since: the chain again, under this lock
            Prompt::Tokens(tokens) if !r.unheld(&st) => {
                r.reset();
                let mut holds = |g, k| st.holds_any(g, k);
                let mut more = |u, key| r.more(&mut holds, u, key);
                chains[i] = Some(Cow::Owned(token_chain(
                    tokens,
                    &plan.configs[i],
                    memo,
                    &mut digests[i],
                    &mut more,
                )?));
            }
            Prompt::Tokens(_) | Prompt::Blocks { .. } => {}
        }
    }
    let hashing_s = t_hash.elapsed().as_secs_f64();
    // an answer to a chain names no hash configuration and spent no time hashing (`decide.route`)
    let hashed = matches!(prompt, Prompt::Tokens(_));
    let t_search = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut touched_sets: Vec<Vec<bool>> = Vec::with_capacity(plan.cohorts.len());
    // Only the best `top_k` rows are shown: members whose hit is bounded below the bar are left
    // out (`Bar`), their bound kept for the memo's held prefix
    let mut bar = top_k.filter(|&k| k >= 1).map(|k| Bar {
        k: k as usize,
        best: Vec::new(),
    });
    let mut held_bound = vec![0i64; plan.configs.len()];
    // block-hash requests: the nodes whose layout the lists do not fit (Python's no-signal rows,
    // cause "lists"), and whether any cohort was searched
    let mut misfits: Vec<(usize, usize)> = Vec::new(); // (node, its reason in `reasons`)
    let mut reasons: Vec<String> = Vec::new();
    let mut searched = false;
    {
        for c in &plan.cohorts {
            let unit = plan.configs[c.config].unit;
            // a block-hash request's lists as sent (their lengths are the prompt's), and where the
            // bound cuts them (`reach.rs`, looked up under the search's lock)
            let mut given_lens: Vec<usize> = Vec::new();
            let lists: Vec<(u64, Cow<[u64]>)> = match prompt {
                Prompt::Blocks { lists, .. } => {
                    let own = match block_lists(lists, &c.groups, num_tokens) {
                        Ok(own) => own,
                        Err(Some(reason)) => {
                            misfits.extend(c.nodes.iter().map(|&node| (node, reasons.len())));
                            reasons.push(reason);
                            touched_sets.push(vec![true; c.nodes.len()]); // never ranked
                            continue;
                        }
                        Err(None) => return None,
                    };
                    given_lens = own.iter().map(|(_, l)| l.len()).collect();
                    // borrowed up to where the bound cuts them
                    let cut = reach[c.config]
                        .as_ref()
                        .and_then(|r| r.cut_blocks(&st, &own, unit))
                        .unwrap_or(usize::MAX);
                    own.iter()
                        .zip(&c.groups)
                        .map(|(&(g, list), &(_, bs))| {
                            (g, Cow::Borrowed(&list[..list.len().min(cut / bs)]))
                        })
                        .collect()
                }
                _ => {
                    let chain = chains[c.config].as_ref().expect("hashed above");
                    c.groups
                        .iter()
                        .map(|&(g, bs)| match bs / unit {
                            // a group hashed in the chain's own unit reads the chain as it is
                            1 => (g, Cow::Borrowed(&chain[..])),
                            k => (
                                g,
                                Cow::Owned(chain.iter().skip(k - 1).step_by(k).copied().collect()),
                            ),
                        })
                        .collect()
                }
            };
            let models: Vec<ModelArgs> = c
                .models
                .iter()
                .map(|m| ModelArgs {
                    layout: m.layout,
                    cap: num_tokens - 1,
                    // the whole prompt's lists, as if uncut (the hit never reads past the cut)
                    num_hashed: c
                        .groups
                        .iter()
                        .enumerate()
                        .zip(&m.units)
                        .map(|((gi, &(_, bs)), u)| match prompt {
                            Prompt::Blocks { .. } => given_lens[gi] as i64 * u,
                            _ => (units[c.config] / (bs / unit)) as i64 * u,
                        })
                        .max()
                        .unwrap_or(0),
                })
                .collect();
            let mut cut = bar.as_mut().map(|bar| CohortBar {
                bar,
                cohort: c,
                live,
                now,
                stale: plan.stale_after.as_ref(),
                cap,
            });
            let lists: Vec<(u64, &[u64])> = lists.iter().map(|(g, l)| (*g, &l[..])).collect();
            let out = route::route_cohort(
                &st,
                &plan.layouts,
                &lists,
                &c.members,
                &models,
                &plan.media_rank,
                ask.prefixes,
                cut.as_mut().map(|p| p as &mut dyn Prune),
            )
            .ok()?;
            let route::CohortOut {
                nodes: out,
                skipped,
            } = out;
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
            searched = true;
            let mut touched = vec![false; c.nodes.len()];
            for &(m, bound) in &skipped {
                touched[m] = true;
                held_bound[c.config] = held_bound[c.config].max(bound);
            }
            for n in out {
                touched[n.member] = true;
                let node = c.nodes[n.member];
                let l = &live[node];
                let loadable = n.any_tokens - n.gpu_tokens;
                let score = score(n.gpu_tokens, loadable, cap, l);
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
    drop(st);
    if !searched {
        return None; // no layout the lists fit: Python's 400 names the first misfit
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
    if let Prompt::Tokens(tokens) = prompt {
        // the longest prefix a node holds, per configuration: those units are worth remembering
        let mut held = held_bound;
        for r in &rows {
            if let Some(n) = &r.out {
                let h = &mut held[r.cohort.config];
                *h = (*h).max(n.any_tokens);
            }
        }
        for (i, chain) in digests.iter().enumerate() {
            if let Some(chain) = chain {
                let cfg = &plan.configs[i];
                let units = held[i] as usize / cfg.unit.max(1);
                *held_ids = (*held_ids).max(units * cfg.unit);
                memo.admit(
                    &cfg.none_hash,
                    tokens,
                    cfg.unit,
                    chain,
                    held[i] as usize / cfg.unit,
                );
            }
        }
    }
    let (hash_blocks, hashing_s) = if hashed {
        (units, hashing_s)
    } else {
        (Vec::new(), 0.0)
    };
    let no_signal = (!misfits.is_empty()).then(|| no_signal_with(plan, &misfits, &reasons));
    Some(write_answer(
        plan,
        live,
        &shown,
        &hash_blocks,
        &config_nodes,
        num_tokens,
        hashing_s,
        search_s,
        now,
        ask.prefixes,
        no_signal.as_deref().unwrap_or(&plan.no_signal),
    ))
}

/// The answer's `no_signal` array with the misfit nodes' entries (`decide.finish` sorts every
/// entry by node id; a node is never in both lists: misfits are eligible, the plan's are not).
fn no_signal_with(plan: &Plan, misfits: &[(usize, usize)], reasons: &[String]) -> String {
    let added: Vec<(&str, String)> = misfits
        .iter()
        .map(|&(node, reason)| {
            let id = plan.nodes[node].id.as_str();
            let mut json = String::from("{\"node_id\":");
            crate::answer::push_str_json(&mut json, id);
            json.push_str(",\"reason\":");
            crate::answer::push_str_json(&mut json, &reasons[reason]);
            json.push_str(",\"cause\":\"lists\"}");
            (id, json)
        })
        .collect();
    let mut entries: Vec<(&str, &str)> = plan
        .no_signal_entries
        .iter()
        .map(|(id, json)| (id.as_str(), json.as_str()))
        .chain(added.iter().map(|(id, json)| (*id, json.as_str())))
        .collect();
    entries.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = String::from("[");
    for (i, (_, json)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(json);
    }
    out.push(']');
    out
}

/// The keys of a token-id prompt's chain for configuration `cfg` (its digests kept in `digests`),
/// hashed while `more` (a unit's index and key) asks for more (`reach.rs`); None where the native
/// hash does not write the prompt.
fn token_chain(
    tokens: &[i64],
    cfg: &Config,
    memo: &HashMemo,
    digests: &mut Option<hashmemo::Chain>,
    more: &mut dyn FnMut(usize, u64) -> bool,
) -> Option<Vec<u64>> {
    let key = |d: &[u8; 32]| u64::from_be_bytes(d[24..].try_into().expect("32-byte digest"));
    let chain = memo.chain_until(&cfg.none_hash, tokens, cfg.unit, &mut |u, d| {
        more(u, key(d))
    })?;
    let keys = chain.digests.iter().map(key).collect();
    *digests = Some(chain);
    Some(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast path against the decimal text on scores and on values a hair from a half.
    #[test]
    fn round9_fast_path_agrees() {
        let text = |x: f64| -> f64 { format!("{x:.9}").parse().unwrap() };
        let mut next = crate::testrng::xorshift(0x9e37_79b9_7f4a_7c15);
        for i in 0..400_000 {
            let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let x = match i % 4 {
                0 => u * 4.0 - 2.0,
                1 => (u * 4.0 - 2.0) * 1e3,
                // a half-unit of the 9th place, give or take a few ulps
                2 => {
                    ((next() % 2_000_000_000) as f64 + 0.5) / 1e9
                        * if i % 8 == 2 { -1.0 } else { 1.0 }
                }
                _ => f64::from_bits(((u * 2.0 - 1.0) / 7.0).to_bits() + next() % 5),
            };
            assert_eq!(round9(x).to_bits(), text(x).to_bits(), "{x:e}");
        }
    }

    #[test]
    fn round9_matches_python() {
        // values from Python's round(x, 9)
        assert_eq!(round9(0.1234567894999), 0.123456789);
        assert_eq!(round9(-0.02), -0.02);
        assert_eq!(round9(1.0000000005), 1.000000001);
        assert_eq!(round9(0.0), 0.0);
    }
}
