//! The native route decision's Python face (`kvpipe_native.NativeRouter`): `processors/router/native.py`
//! exports the plan and the nodes' live state into it and starts the route server on it.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::decide::{CohortPlan, Config, Live, ModelPlan, NodePlan, Plan, Router};
use crate::pyhit::HitEngine;
use crate::pyserve::RouteServer;
use crate::pystore::IndexStore;
use crate::route::Members;
use crate::{err, serve};

/// (config index, [(group, block size)], owners, model index per member, plan node per member,
/// [(layout id, units per group, GroupHit JSON head per group)])
type CohortArgs = (
    usize,
    Vec<(u64, usize)>,
    Vec<u32>,
    Vec<u16>,
    Vec<usize>,
    Vec<(usize, Vec<i64>, Vec<String>)>,
);
/// (suspect reason as a JSON string or None, last seen, running, waiting, kv usage)
type LiveArgs = (Option<String>, f64, i64, i64, f64);

#[pyclass(module = "kvpipe_native", frozen)]
pub(crate) struct NativeRouter {
    inner: Arc<Router>,
}

fn lives(live: Vec<LiveArgs>) -> Vec<Live> {
    live.into_iter()
        .map(|(suspect, last_seen, running, waiting, kv_usage)| {
            Live::new(suspect, last_seen, running, waiting, kv_usage)
        })
        .collect()
}

#[pymethods]
impl NativeRouter {
    #[new]
    #[pyo3(signature = (store, memo_entries = crate::hashmemo::DEFAULT_CAPACITY))]
    fn new(store: PyRef<'_, IndexStore>, memo_entries: usize) -> Self {
        NativeRouter {
            inner: Arc::new(Router::new(store.inner.clone(), memo_entries)),
        }
    }

    /// What the digest memo did (`hashmemo.rs`): units read from it and hashed, units admitted,
    /// entries held now; and the id-text memo (`idtext.rs`): ids read from it, admitted, held now.
    fn memo_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.memo_stats();
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("admitted", s.admitted)?;
        d.set_item("entries", s.entries)?;
        d.set_item("capacity", s.capacity)?;
        // the id-text memo (`idtext.rs`): ids read from remembered text, admitted, held now
        let t = self.inner.text_stats();
        d.set_item("text_taken", t.taken)?;
        d.set_item("text_admitted", t.admitted)?;
        d.set_item("text_ids", t.ids)?;
        Ok(d)
    }

    /// A new plan (see `decide::Plan`), with the live state of its nodes in plan order.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (generation, engine, configs, cohorts, nodes, no_signal, model, media_rank, media,
                        stale_after, live, block_routes=false, no_signal_entries=None))]
    fn set_plan(
        &self,
        generation: u64,
        engine: PyRef<'_, HitEngine>,
        configs: Vec<(Vec<u8>, usize, String)>,
        cohorts: Vec<CohortArgs>,
        nodes: Vec<(String, String)>,
        no_signal: String,
        model: String,
        media_rank: Vec<u32>,
        media: Vec<String>,
        stale_after: Option<(f64, String)>,
        live: Vec<LiveArgs>,
        block_routes: bool,
        no_signal_entries: Option<Vec<(String, String)>>,
    ) -> PyResult<()> {
        if live.len() != nodes.len() {
            return Err(err("live state and nodes differ in length".into()));
        }
        let layouts = engine.layouts.clone();
        let mut plan_cohorts = Vec::with_capacity(cohorts.len());
        for (config, groups, owners, models_of, node_of, models) in cohorts {
            if config >= configs.len() || node_of.iter().any(|&n| n >= nodes.len()) {
                return Err(err(
                    "a cohort names a configuration or node past the plan's".into(),
                ));
            }
            let unit = configs[config].1;
            if unit == 0 || groups.iter().any(|&(_, bs)| bs == 0 || bs % unit != 0) {
                return Err(err(
                    "a group's block size is not a whole number of hash units".into(),
                ));
            }
            let models = models
                .into_iter()
                .map(|(layout, units, group_heads)| {
                    if layout >= layouts.len()
                        || units.len() != groups.len()
                        || group_heads.len() != groups.len()
                    {
                        return Err(err(
                            "a model's layout, units or group heads do not fit its cohort".into(),
                        ));
                    }
                    Ok(ModelPlan {
                        layout,
                        units,
                        group_heads,
                    })
                })
                .collect::<PyResult<Vec<_>>>()?;
            if node_of.len() != owners.len() {
                return Err(err("a cohort's members and nodes differ in length".into()));
            }
            plan_cohorts.push(CohortPlan {
                config,
                groups,
                members: Members::new(owners, models_of).map_err(err)?,
                nodes: node_of,
                models,
            });
        }
        let plan = Plan {
            generation,
            configs: configs
                .into_iter()
                .map(|(none_hash, unit, json_head)| Config {
                    none_hash,
                    unit,
                    json_head,
                })
                .collect(),
            cohorts: plan_cohorts,
            nodes: nodes
                .into_iter()
                .map(|(id, head)| NodePlan { id, head })
                .collect(),
            no_signal,
            no_signal_entries: no_signal_entries.unwrap_or_default(),
            model,
            layouts,
            media_rank,
            media,
            stale_after,
            block_routes,
        };
        self.inner.set_plan(plan, lives(live));
        Ok(())
    }

    fn set_live(&self, live: Vec<LiveArgs>) {
        self.inner.set_live(lives(live));
    }

    fn set_generation(&self, generation: u64) {
        self.inner.set_generation(generation);
    }

    fn set_open(&self, open: bool) {
        self.inner.set_open(open);
    }

    /// Whether a request would be answered natively now.
    #[getter]
    fn ready(&self) -> bool {
        self.inner.ready()
    }

    /// Start the route server on this router: `POST /route` answered here when it can be, everything
    /// else forwarded to the Python app at `upstream_port` on loopback.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (host, port, threads, token, max_body_bytes, read_timeout_s, upstream_port, reuse_port=false,
                        nice=0))]
    fn serve(
        &self,
        host: String,
        port: u16,
        threads: usize,
        token: Option<String>,
        max_body_bytes: usize,
        read_timeout_s: f64,
        upstream_port: Option<u16>,
        reuse_port: bool,
        nice: i32,
    ) -> PyResult<RouteServer> {
        let cfg = serve::ServerConfig {
            host,
            port,
            threads: threads.max(1),
            token: token.filter(|t| !t.is_empty()),
            max_body_bytes,
            read_timeout: std::time::Duration::from_secs_f64(read_timeout_s.max(0.001)),
            upstream: upstream_port.map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p))),
            reuse_port,
            nice,
        };
        RouteServer::launch(cfg, self.inner.clone())
    }

    /// The answer to a `/route` body, or None where Python answers (in process; the GIL released).
    fn route<'py>(&self, py: Python<'py>, body: &[u8]) -> Option<Bound<'py, PyBytes>> {
        let inner = self.inner.clone();
        let out = py.allow_threads(|| inner.answer(body))?;
        Some(PyBytes::new(py, &out))
    }
}

impl serve::Decide for Router {
    fn route(&self, body: &[u8]) -> Option<serve::Answer> {
        self.answer(body)
            .map(|body| serve::Answer { status: 200, body })
    }
}
