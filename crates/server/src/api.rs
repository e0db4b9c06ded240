//! The OpenAI request bodies and their validation: everything a request asks for is checked
//! here, at the edge, before anything is queued; a bad value is a 400 naming the field.

use crate::error::ApiError;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sluice_runtime::spec::SpecMethod;
use sluice_runtime::SamplerConfig;

/// The fields of `/v1/chat/completions` and `/v1/completions` bodies (unknown fields are
/// ignored, as OpenAI's clients send many).
#[derive(Deserialize, Default, Debug)]
pub struct RequestBody {
    pub model: Option<Value>,
    /// Kept as written: tool definitions and message contents keep their key order.
    pub messages: Option<Box<RawValue>>,
    pub prompt: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub n: Option<i64>,
    pub tools: Option<Box<RawValue>>,
    pub tool_choice: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    pub logit_bias: Option<Value>,
    pub response_format: Option<Value>,
    /// Keep generating past end-of-sequence and end-of-turn tokens (llama.cpp's extension).
    pub ignore_eos: Option<bool>,
    /// Speculative decoding (sluice's extension): "ngram", "draft" (the server's draft model),
    /// "mtp" (the model's multi-token-prediction head), "self" (the model through its cached
    /// experts) or "none"; absent, the server's default (`sluice serve --spec`).
    pub spec: Option<Value>,
    /// The most tokens drafted a step when speculating (sluice's extension).
    pub draft_max: Option<i64>,
}

#[derive(Deserialize, Default, Debug)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Parses a body, naming the field of a type error.
pub fn parse_body(bytes: &[u8]) -> Result<RequestBody, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request("the request body is empty: expected a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || path == "." {
            ApiError::bad_request(format!("invalid JSON in the request body: {inner}"))
        } else {
            ApiError::invalid(&path, format!("`{path}`: {inner}"))
        }
    })
}

/// What a request asks of generation, validated.
#[derive(Clone, Debug)]
pub struct Params {
    pub stream: bool,
    pub include_usage: bool,
    /// None: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Some(n): report log-probabilities with the n most likely tokens.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// Pass the tools to the template (tool_choice is not "none").
    pub use_tools: bool,
    /// Speculate by this method (Some(None): not); None: the server's default.
    pub spec: Option<Option<SpecMethod>>,
    /// The most tokens drafted a step, if the request says.
    pub draft_max: Option<usize>,
}

/// The most tokens a request may have drafted a step.
pub const DRAFT_MAX_LIMIT: usize = 64;

fn range(param: &str, v: Option<f64>, lo: f64, hi: f64, default: f64) -> Result<f32, ApiError> {
    match v {
        None => Ok(default as f32),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x as f32),
        Some(x) => Err(ApiError::invalid(param, format!("`{param}` must be between {lo} and {hi}, got {x}"))),
    }
}

/// Validates everything but the prompt (`chat`: the chat endpoint's rules).
pub fn params(b: &RequestBody, chat: bool) -> Result<Params, ApiError> {
    if let Some(n) = b.n {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("only n = 1 is supported, got {n}")));
        }
    }
    let max_tokens = match (chat, b.max_completion_tokens, b.max_tokens) {
        (true, Some(v), _) => Some(("max_completion_tokens", v)),
        (_, _, Some(v)) => Some(("max_tokens", v)),
        (false, Some(v), None) => Some(("max_completion_tokens", v)),
        _ => None,
    };
    let max_tokens = match max_tokens {
        None => None,
        Some((name, v)) if v >= 1 => Some(usize::try_from(v).map_err(|_| ApiError::invalid(name, "too large"))?),
        Some((name, v)) => return Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {v}"))),
    };
    let temperature = range("temperature", b.temperature, 0.0, 2.0, 1.0)?;
    let top_p = range("top_p", b.top_p, 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
    }
    let min_p = range("min_p", b.min_p, 0.0, 1.0, 0.0)?;
    let presence_penalty = range("presence_penalty", b.presence_penalty, -2.0, 2.0, 0.0)?;
    let frequency_penalty = range("frequency_penalty", b.frequency_penalty, -2.0, 2.0, 0.0)?;
    let top_k = match b.top_k {
        None => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => return Err(ApiError::invalid("top_k", format!("`top_k` must be at least 0, got {k}"))),
    };
    let seed = match b.seed {
        Some(s) => s as u64,
        None => getrandom::u64().map_err(|e| ApiError::internal(format!("no random seed: {e}")))?,
    };
    let stop = match &b.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut v = Vec::new();
            for s in a {
                match s {
                    Value::String(s) => v.push(s.clone()),
                    _ => return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings")),
                }
            }
            v
        }
        Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings")),
    };
    if stop.len() > 16 {
        return Err(ApiError::invalid("stop", format!("at most 16 stop strings, got {}", stop.len())));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let logprobs = if chat {
        let on = match &b.logprobs {
            None | Some(Value::Null) => false,
            Some(Value::Bool(v)) => *v,
            Some(_) => return Err(ApiError::invalid("logprobs", "`logprobs` must be a boolean")),
        };
        match b.top_logprobs {
            Some(n) if !(0..=20).contains(&n) => {
                return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` must be 0 to 20, got {n}")))
            }
            Some(_) if !on => {
                return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
            }
            Some(n) => Some(n as usize),
            None => on.then_some(0),
        }
    } else {
        match &b.logprobs {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_i64() {
                Some(n) if (0..=20).contains(&n) => Some(n as usize),
                _ => return Err(ApiError::invalid("logprobs", "`logprobs` must be an integer from 0 to 20")),
            },
        }
    };
    if b.echo == Some(true) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    if b.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("best_of", "only best_of = 1 is supported"));
    }
    if b.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    if b.logit_bias.as_ref().is_some_and(|v| v.as_object().is_some_and(|o| !o.is_empty())) {
        return Err(ApiError::invalid("logit_bias", "`logit_bias` is not supported"));
    }
    if let Some(rf) = &b.response_format {
        let ty = rf.get("type").and_then(Value::as_str);
        if !(rf.is_null() || ty == Some("text")) {
            return Err(ApiError::invalid("response_format", "only `{\"type\": \"text\"}` is supported"));
        }
    }
    let use_tools = match &b.tool_choice {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(_) => {
            return Err(ApiError::invalid("tool_choice", "`tool_choice` may be \"auto\" or \"none\""));
        }
    };
    let include_usage = b.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    if b.stream_options.is_some() && b.stream != Some(true) {
        return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed with `stream: true`"));
    }
    let spec = match &b.spec {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "ngram" => Some(Some(SpecMethod::Ngram)),
        Some(Value::String(s)) if s == "draft" => Some(Some(SpecMethod::Draft)),
        Some(Value::String(s)) if s == "mtp" => Some(Some(SpecMethod::Mtp)),
        Some(Value::String(s)) if s == "self" => Some(Some(SpecMethod::Cached)),
        Some(Value::String(s)) if s == "none" => Some(None),
        Some(_) => {
            return Err(ApiError::invalid("spec", "`spec` must be \"ngram\", \"draft\", \"mtp\", \"self\" or \"none\""))
        }
    };
    let draft_max = match b.draft_max {
        None => None,
        Some(k) if (1..=DRAFT_MAX_LIMIT as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid("draft_max", format!("`draft_max` must be 1 to {DRAFT_MAX_LIMIT}, got {k}")))
        }
    };
    let sampler = SamplerConfig { temperature, top_p, top_k, seed, min_p, presence_penalty, frequency_penalty };
    sampler.validate().map_err(ApiError::bad_request)?;
    Ok(Params {
        stream: b.stream.unwrap_or(false),
        include_usage,
        max_tokens,
        sampler,
        stop,
        logprobs,
        ignore_eos: b.ignore_eos.unwrap_or(false),
        use_tools,
        spec,
        draft_max,
    })
}

/// A completion prompt: text, or token ids.
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt` of /v1/completions: a string, a list of one string, a list of token ids, or a
/// list of one list of token ids.
pub fn prompt(b: &RequestBody) -> Result<Prompt, ApiError> {
    let bad = || ApiError::invalid("prompt", "`prompt` must be a string or a list of token ids (one prompt)");
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)).collect()
    };
    let p = match &b.prompt {
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(inner)] => Prompt::Tokens(ids(inner)?),
            [] => return Err(ApiError::invalid("prompt", "`prompt` is empty")),
            a if a.iter().all(Value::is_number) => Prompt::Tokens(ids(a)?),
            _ => return Err(ApiError::invalid("prompt", "only one prompt per request is supported")),
        },
        Some(_) => return Err(bad()),
    };
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(j: &str) -> Result<RequestBody, ApiError> {
        parse_body(j.as_bytes())
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = body(r#"{"max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = body(r#"{"messages": [1,"#).unwrap_err();
        assert!(e.message.contains("invalid JSON"), "{}", e.message);
        assert!(body("").is_err());
    }

    #[test]
    fn values_are_checked() {
        let p = |j: &str| params(&body(j).unwrap(), true);
        assert_eq!(p(r#"{"max_tokens": -1}"#).unwrap_err().param.as_deref(), Some("max_tokens"));
        assert_eq!(p(r#"{"max_completion_tokens": 0}"#).unwrap_err().param.as_deref(), Some("max_completion_tokens"));
        assert_eq!(p(r#"{"n": 2}"#).unwrap_err().param.as_deref(), Some("n"));
        assert_eq!(p(r#"{"temperature": 3}"#).unwrap_err().param.as_deref(), Some("temperature"));
        assert_eq!(p(r#"{"top_p": 0}"#).unwrap_err().param.as_deref(), Some("top_p"));
        assert_eq!(p(r#"{"stop": [1]}"#).unwrap_err().param.as_deref(), Some("stop"));
        assert_eq!(p(r#"{"top_logprobs": 3}"#).unwrap_err().param.as_deref(), Some("top_logprobs"));
        assert_eq!(
            p(r#"{"stream_options": {"include_usage": true}}"#).unwrap_err().param.as_deref(),
            Some("stream_options")
        );
        let ok =
            p(r#"{"max_tokens": 5, "stop": "x", "logprobs": true, "top_logprobs": 2, "seed": 9, "n": 1}"#).unwrap();
        assert_eq!(
            (ok.max_tokens, ok.stop, ok.logprobs, ok.sampler.seed),
            (Some(5), vec!["x".to_string()], Some(2), 9)
        );
        // Completions: logprobs is a count.
        let c = params(&body(r#"{"logprobs": 3}"#).unwrap(), false).unwrap();
        assert_eq!(c.logprobs, Some(3));
    }

    #[test]
    fn prompts_parse() {
        let pr = |j: &str| prompt(&body(j).unwrap());
        assert!(matches!(pr(r#"{"prompt": "hi"}"#), Ok(Prompt::Text(s)) if s == "hi"));
        assert!(matches!(pr(r#"{"prompt": [1, 2]}"#), Ok(Prompt::Tokens(t)) if t == vec![1, 2]));
        assert!(matches!(pr(r#"{"prompt": [[3]]}"#), Ok(Prompt::Tokens(t)) if t == vec![3]));
        assert!(pr(r#"{"prompt": ["a", "b"]}"#).is_err());
        assert!(pr(r#"{"prompt": [-1]}"#).is_err());
        assert!(pr(r#"{}"#).is_err());
    }
}
