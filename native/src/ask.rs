//! What a `POST /route` body asks, read for the native decision (`decide.rs`): the prompt as token
//! ids, as its hash-unit chain or as per-group block hashes, `top_k`, the semantics. Only what the native path answers exactly
//! as Python does is accepted; anything else (an unknown field, a value Python would refuse or
//! check further) makes `Request::ask` return None, and the request goes to the Python app, whose
//! 400s and 413s name the field (`processors/router/request.py`).

use serde::Deserialize;

/// `processors/router/request.py: MAX_TOKENS`; longer prompts get Python's 413.
pub const MAX_TOKENS: usize = 1_000_000;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Request {
    #[serde(default)]
    pub(crate) token_ids: Option<Vec<i64>>,
    /// The prompt's hash-unit chain (`processors/router/request.py: _check_units`), as store keys.
    #[serde(default)]
    pub(crate) unit_hashes: Option<Vec<UnitKey>>,
    /// Per group its block hashes at that group's block size, sorted by group (only `askread`
    /// reads them: a body serde would have to take is left to Python).
    #[serde(skip)]
    pub(crate) block_hashes: Option<Vec<(u64, Vec<UnitKey>)>>,
    #[serde(default)]
    pub(crate) hash_block_size: Option<i64>,
    #[serde(default)]
    pub(crate) num_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) top_k: Option<i64>,
    /// "hma" (the default) or "prefix-per-group"; any other value, `null` included (Python's 400),
    /// fails the parse.
    #[serde(default)]
    pub(crate) semantics: Semantics,
    /// Where `askread` found the token ids' text (never serde: a body it reads is not remembered).
    #[serde(skip)]
    pub(crate) token_text: Option<TokenText>,
}

/// Where a body's token ids are written: how many leading ids the id-text memo's newer generation
/// spelled, and the byte offset of the first id after them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TokenText {
    pub(crate) remembered: usize,
    pub(crate) resume: usize,
}

#[derive(Deserialize, Default, PartialEq, Debug)]
pub(crate) enum Semantics {
    #[default]
    #[serde(rename = "hma")]
    Hma,
    /// each group's row also says its longest held prefix
    #[serde(rename = "prefix-per-group")]
    PrefixPerGroup,
}

/// `processors/router/request.py: MAX_HASHES`.
pub const MAX_HASHES: usize = 100_000;

/// One hash of a request's chain as the store keys it (`processors/core/slots.py: key_of`): an int
/// (vLLM's external form, `0 <= h < 2**64`) as it is, `"0x…"` bytes by their last 8 bytes read
/// big-endian. Anything else fails the parse, and the request goes to Python, which names the field.
#[derive(Debug)]
pub(crate) struct UnitKey(pub(crate) u64);

impl UnitKey {
    pub(crate) fn from_hex(v: &str) -> Option<UnitKey> {
        hex_key(v).map(UnitKey)
    }
}

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
pub(crate) struct Ask {
    pub(crate) prompt: Prompt,
    pub(crate) top_k: Option<i64>,
    /// semantics "prefix-per-group": every group row carries `prefix_blocks`
    pub(crate) prefixes: bool,
}

/// The prompt of a request: token ids to hash, the chain already hashed, or each group's blocks.
pub(crate) enum Prompt {
    Tokens(Vec<i64>),
    Units {
        keys: Vec<u64>,
        unit: usize,
        num_tokens: i64,
    },
    /// Per group (ascending, each once) its block hashes as store keys. Only with `num_tokens`: without
    /// it Python's rows are not exact (the hit is not capped), which the native answer never writes.
    Blocks {
        lists: Vec<(u64, Vec<u64>)>,
        num_tokens: i64,
    },
}

impl Request {
    /// The request in `body`, read by `askread` when it takes the body and by serde otherwise;
    /// None where serde refuses it (Python then answers).
    pub(crate) fn read(body: &[u8], memo: Option<&crate::idtext::IdText>) -> Option<Request> {
        crate::askread::read_with(body, memo).or_else(|| serde_json::from_slice(body).ok())
    }

    /// Every field, for comparing two readings in tests.
    #[cfg(test)]
    pub(crate) fn debug(&self) -> String {
        format!(
            "{:?} {:?} {:?} {:?} {:?} {:?} {:?}",
            self.token_ids,
            self.unit_hashes,
            self.block_hashes,
            self.hash_block_size,
            self.num_tokens,
            self.top_k,
            self.semantics
        )
    }

    /// What the request asks when it is one this module answers exactly as Python would; None for
    /// Python to answer (its 400s and 413s say what is wrong).
    pub(crate) fn ask(self) -> Option<Ask> {
        if self.top_k.is_some_and(|k| k < 1) {
            return None;
        }
        let prefixes = self.semantics == Semantics::PrefixPerGroup;
        let top_k = self.top_k;
        let prompt = match (self.token_ids, self.unit_hashes, self.block_hashes) {
            (Some(tokens), None, None) => {
                let ok = !tokens.is_empty()
                    && tokens.len() <= MAX_TOKENS
                    && self.num_tokens.is_none()
                    && self.hash_block_size.is_none();
                ok.then_some(Prompt::Tokens(tokens))
            }
            (None, Some(units), None) => {
                let unit = self.hash_block_size.filter(|&u| u >= 1)?;
                let n = self.num_tokens.filter(|&n| n >= 1)?;
                let ok = units.len() <= MAX_HASHES && units.len() as i64 == n / unit;
                ok.then(|| Prompt::Units {
                    keys: units.into_iter().map(|k| k.0).collect(),
                    unit: unit as usize,
                    num_tokens: n,
                })
            }
            // `processors/router/request.py: check_request`: a unit size is Python's 400, as are no
            // group, a negative group (never read here) and more than MAX_HASHES hashes; a group
            // without blocks is left to Python too (nothing to search)
            (None, None, Some(lists)) => {
                let n = self.num_tokens.filter(|&n| n >= 1)?;
                let total: usize = lists.iter().map(|(_, keys)| keys.len()).sum();
                let ok = self.hash_block_size.is_none()
                    && !lists.is_empty()
                    && total <= MAX_HASHES
                    && lists.iter().all(|(_, keys)| !keys.is_empty());
                ok.then(|| Prompt::Blocks {
                    lists: lists
                        .into_iter()
                        .map(|(g, keys)| (g, keys.into_iter().map(|k| k.0).collect()))
                        .collect(),
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
