//! kvpipe's envelope (`schemas/envelope.py: Envelope`, a msgpack map with field names) read
//! straight from bytes, for the ingest run (`processors/core/ingestrun.py`): the fields the index's
//! common case reads, with the embedded vLLM batch read in place by `batch::parse_into`.
//!
//! Like the batch reader, this accepts a strict subset of what `schemas/codec.py:
//! decode_envelope` accepts, and only envelopes that pass its validation: every known field with
//! exactly the msgpack type the reference decodes it from (`float` fields from float64 only), no
//! unknown or repeated keys, `v` equal to the schema major version, nothing after the map. An
//! envelope outside that subset, or one the common case does not cover (group specs, a hash
//! configuration, dropped events, lost batches), returns `None`: the caller hands the record to the
//! reference path (`processors/core/ingest.py: Ingest.handle`), which applies it or says precisely what
//! is wrong, so outcomes and DLQ reasons stay the reference's.

use crate::batch::{self, Parsed, Rd};
use rmp::Marker;

/// `schemas/envelope.py: SCHEMA_MAJOR`.
pub const SCHEMA_MAJOR: i64 = 1;

/// The envelope's fields the common case reads. `batch` holds the events when the envelope has a
/// batch (`has_batch`); a heartbeat leaves it untouched.
pub struct Env<'a> {
    pub node_id: &'a str,
    pub epoch: i64,
    pub seq: i64,
    pub ts: f64,
    pub sent_ts: f64,
    pub model: Option<&'a str>,
    pub dp_rank: Option<i64>,
    pub has_batch: bool,
    pub spec_mismatches: i64,
    pub running: Option<i64>,
    pub waiting: Option<i64>,
    pub kv_usage: Option<f64>,
}

impl Env<'_> {
    /// The node's own clock for this envelope (`Index.apply`'s `seen`).
    pub fn seen(&self) -> f64 {
        if self.sent_ts > self.ts {
            self.sent_ts
        } else {
            self.ts
        }
    }

    pub fn reports_load(&self) -> bool {
        self.running.is_some() || self.waiting.is_some() || self.kv_usage.is_some()
    }
}

fn f64_only(rd: &mut Rd) -> Option<f64> {
    if batch::peek(rd)? != Marker::F64 {
        return None;
    }
    rmp::decode::read_f64(rd).ok()
}

fn opt_f64(rd: &mut Rd) -> Option<Option<f64>> {
    if batch::is_nil(rd) {
        return Some(None);
    }
    f64_only(rd).map(Some)
}

/// Finite and non-negative (`codec.validate_envelope`'s rule for times; NaN fails it).
fn valid_time(v: f64) -> bool {
    (0.0..f64::INFINITY).contains(&v)
}

/// The envelope's fields by number (`Envelope`'s order); keys are matched as bytes (a known
/// name is ASCII, so a match needs no UTF-8 check and anything else is refused).
const F_V: u32 = 0;
const F_NODE_ID: u32 = 1;
const F_EPOCH: u32 = 2;
const F_SEQ: u32 = 3;
const F_TS: u32 = 4;
const F_SENT_TS: u32 = 5;
const F_MODEL: u32 = 6;
const F_DP_RANK: u32 = 7;
const F_GROUP_SPECS: u32 = 8;
const F_HASH_CONFIG: u32 = 9;
const F_DROPPED: u32 = 10;
const F_LOST_BATCHES: u32 = 11;
const F_NUM_EVENTS: u32 = 12;
const F_BATCH: u32 = 13;
const F_SOURCE: u32 = 14;
const F_UPSTREAM_SEQ: u32 = 15;
const F_LAYOUT: u32 = 16;
const F_SPEC_MISMATCHES: u32 = 17;
const F_RUNNING: u32 = 18;
const F_WAITING: u32 = 19;
const F_KV_USAGE: u32 = 20;

fn field(key: &[u8]) -> Option<u32> {
    Some(match key {
        b"v" => F_V,
        b"node_id" => F_NODE_ID,
        b"epoch" => F_EPOCH,
        b"seq" => F_SEQ,
        b"ts" => F_TS,
        b"sent_ts" => F_SENT_TS,
        b"model" => F_MODEL,
        b"dp_rank" => F_DP_RANK,
        b"group_specs" => F_GROUP_SPECS,
        b"hash_config" => F_HASH_CONFIG,
        b"dropped" => F_DROPPED,
        b"lost_batches" => F_LOST_BATCHES,
        b"num_events" => F_NUM_EVENTS,
        b"batch" => F_BATCH,
        b"source" => F_SOURCE,
        b"upstream_seq" => F_UPSTREAM_SEQ,
        b"layout" => F_LAYOUT,
        b"spec_mismatches" => F_SPEC_MISMATCHES,
        b"running" => F_RUNNING,
        b"waiting" => F_WAITING,
        b"kv_usage" => F_KV_USAGE,
        _ => return None,
    })
}

/// The envelope in `data`, its batch (if any) read into `events`; None: the reference path's.
pub fn decode<'a>(data: &'a [u8], events: &mut Parsed) -> Option<Env<'a>> {
    let mut rd: Rd<'a> = data;
    let rd = &mut rd;
    let n = batch::map_len(rd)?;
    let mut env = Env {
        node_id: "",
        epoch: 0,
        seq: 0,
        ts: 0.0,
        sent_ts: 0.0,
        model: None,
        dp_rank: None,
        has_batch: false,
        spec_mismatches: 0,
        running: None,
        waiting: None,
        kv_usage: None,
    };
    let mut seen = 0u32;
    let mut layout_map = true;
    for _ in 0..n {
        let f = field(batch::raw_str(rd)?)?;
        if seen & (1 << f) != 0 {
            return None;
        }
        seen |= 1 << f;
        match f {
            F_V => {
                if batch::int_i64(rd)? != SCHEMA_MAJOR {
                    return None;
                }
            }
            F_NODE_ID => env.node_id = batch::string(rd)?,
            F_EPOCH => env.epoch = batch::int_i64(rd)?,
            F_SEQ => env.seq = batch::int_i64(rd)?,
            F_TS => env.ts = f64_only(rd)?,
            F_SENT_TS => env.sent_ts = f64_only(rd)?,
            F_MODEL => env.model = batch::opt_string(rd)?,
            F_DP_RANK => env.dp_rank = batch::opt_int(rd)?,
            // the rules they feed (generation, layout checks, resync) are the reference's
            F_GROUP_SPECS | F_HASH_CONFIG => {
                if !batch::is_nil(rd) {
                    return None;
                }
            }
            F_DROPPED | F_LOST_BATCHES => {
                if batch::int_i64(rd)? != 0 {
                    return None;
                }
            }
            F_NUM_EVENTS => {
                batch::int_i64(rd)?;
            }
            F_UPSTREAM_SEQ => {
                batch::opt_int(rd)?;
            }
            F_SOURCE => {
                batch::string(rd)?;
            }
            F_LAYOUT => layout_map = batch::string(rd)? == "map",
            F_SPEC_MISMATCHES => env.spec_mismatches = batch::int_i64(rd)?,
            F_RUNNING => env.running = batch::opt_int(rd)?,
            F_WAITING => env.waiting = batch::opt_int(rd)?,
            F_KV_USAGE => env.kv_usage = opt_f64(rd)?,
            F_BATCH => {
                batch::parse_into(rd, events)?;
                env.has_batch = true;
            }
            _ => return None,
        }
    }
    let required = [F_V, F_NODE_ID, F_EPOCH, F_SEQ, F_TS]
        .iter()
        .fold(0, |a, f| a | 1 << f);
    if seen & required != required || !rd.is_empty() {
        return None;
    }
    // a batch in the array layout (vLLM <= 0.23) is the reference decoder's
    if env.has_batch && !layout_map {
        return None;
    }
    // `codec.validate_envelope`: whatever it refuses goes to the reference path, which says why
    let valid = !env.node_id.is_empty()
        && env.epoch >= 0
        && env.seq >= 0
        && env.running.is_none_or(|r| r >= 0)
        && env.waiting.is_none_or(|w| w >= 0)
        && env.kv_usage.is_none_or(valid_time)
        && valid_time(env.ts)
        && valid_time(env.sent_ts);
    valid.then_some(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field name and what writes its value.
    type Field<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));

    fn map(fields: &[Field]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_map_len(&mut out, fields.len() as u32).unwrap();
        for (k, v) in fields {
            rmp::encode::write_str(&mut out, k).unwrap();
            v(&mut out);
        }
        out
    }

    fn base(extra: &[Field]) -> Vec<u8> {
        let mut fields: Vec<Field> = vec![
            ("v", &|o| rmp::encode::write_uint(o, 1).map(|_| ()).unwrap()),
            ("node_id", &|o| rmp::encode::write_str(o, "n1").unwrap()),
            ("epoch", &|o| {
                rmp::encode::write_uint(o, 2).map(|_| ()).unwrap()
            }),
            ("seq", &|o| {
                rmp::encode::write_uint(o, 7).map(|_| ()).unwrap()
            }),
            ("ts", &|o| rmp::encode::write_f64(o, 5.0).unwrap()),
        ];
        fields.extend_from_slice(extra);
        map(&fields)
    }

    #[test]
    fn reads_a_heartbeat() {
        let data = base(&[]);
        let mut p = Parsed::default();
        let env = decode(&data, &mut p).expect("decodes");
        assert_eq!((env.node_id, env.epoch, env.seq, env.ts), ("n1", 2, 7, 5.0));
        assert!(!env.has_batch);
    }

    #[test]
    fn leaves_what_the_common_case_does_not_cover() {
        let mut p = Parsed::default();
        let unknown = base(&[("other", &|o| rmp::encode::write_nil(o).unwrap())]);
        assert!(decode(&unknown, &mut p).is_none());
        let dropped = base(&[("dropped", &|o| {
            rmp::encode::write_uint(o, 3).map(|_| ()).unwrap()
        })]);
        assert!(decode(&dropped, &mut p).is_none());
        let int_ts = base(&[("sent_ts", &|o| {
            rmp::encode::write_uint(o, 3).map(|_| ()).unwrap()
        })]);
        assert!(decode(&int_ts, &mut p).is_none());
        let mut trailing = base(&[]);
        trailing.push(0xc0);
        assert!(decode(&trailing, &mut p).is_none());
    }
}
