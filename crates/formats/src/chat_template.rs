//! Chat templates: a model's own Jinja template turns a conversation into prompt text.
//!
//! Templates are written for Python's Jinja2 as Hugging Face transformers runs it, and are
//! rendered here with minijinja set up the same way: `trim_blocks` and `lstrip_blocks`, loop
//! controls (`break`, `continue`), Python string/dict/list methods (`.strip()`, `.split()`,
//! `.startswith()`, `.items()`, `.get()`, ... from minijinja-contrib's pycompat),
//! `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter that writes what Python's
//! `json.dumps` writes (`", "` and `": "` separators, non-ASCII kept, `indent`,
//! `separators`, `sort_keys`, `ensure_ascii`), and `None`/`True`/`False`, lists and dicts
//! printed as Python prints them.
//!
//! The variables a template sees are the ones llama.cpp's server passes (`--jinja`), so the
//! rendered prompt is the one it renders: `messages` (role, content, then `name`,
//! `tool_call_id` and `tool_calls` where a message has them), `tools` when tools are given,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `date_string` and `datetime` (today),
//! `enable_thinking` (true unless set otherwise), and any extra variables. Like llama.cpp,
//! the template is probed once for what it understands, and the messages are adapted to it:
//! content given as a list of text parts is joined with newlines for a template that only
//! prints strings (and a string becomes a one-part list for a template that only reads
//! parts); a leading system message is merged into the next message when the template
//! ignores the system role; tool-call arguments (a JSON string here, as in the OpenAI API)
//! are handed over as a parsed object when the template reads them as one. transformers'
//! `{% generation %}` blocks render their body. Not supported: mutating a list in place
//! (`list.append(x)`; minijinja's values are immutable).
//!
//! Where a template comes from: the GGUF metadata key `tokenizer.chat_template` (and
//! `tokenizer.chat_template.tool_use`, used when tools are given); in a Hugging Face
//! directory `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string,
//! or a list of named templates of which "default" is taken and "tool_use" kept for tools).
//! Errors name that source and, for a template's own errors, the line.
//!
//! `parse_tool_calls` reads the tool calls a model writes in the Qwen/Hermes format,
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, back out of generated text;
//! `parse_tool_calls_offered` also takes bare call objects naming an offered tool.

use crate::gguf::GgufFile;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use std::fmt::Write as _;
use std::path::Path;

/// llama.cpp's template for models without one (ChatML).
pub const CHATML: &str = "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}";

/// The texts that end a turn in the common chat formats. A template that writes one of them
/// expects the model to stop there.
pub const END_OF_TURN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
];

/// What went wrong with a chat template, naming where it came from and, when known, the line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTemplateError {
    /// The template's source (a file, or a metadata key of a file).
    pub origin: String,
    pub line: Option<usize>,
    pub message: String,
}

impl std::fmt::Display for ChatTemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "chat template ({}), line {l}: {}", self.origin, self.message),
            None => write!(f, "chat template ({}): {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for ChatTemplateError {}

/// What a message says: a string, or a list of text parts (OpenAI's `[{"type": "text", ...}]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    Text(String),
    Parts(Vec<String>),
}

impl Content {
    /// The text, parts joined by newlines (as llama.cpp joins them).
    pub fn text(&self) -> String {
        match self {
            Content::Text(s) => s.clone(),
            Content::Parts(p) => p.join("\n"),
        }
    }
}

/// A call of a tool: its name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    /// A JSON object, as text.
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    pub content: Content,
    /// Calls an assistant message made.
    pub tool_calls: Vec<ToolCall>,
    /// The call a tool message answers.
    pub tool_call_id: Option<String>,
    /// The tool's name, on a tool message.
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: Content::Text(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }

    /// A tool's result, answering the call `tool_call_id`.
    pub fn tool(content: impl Into<String>, tool_call_id: Option<String>) -> Message {
        Message { tool_call_id, ..Message::new("tool", content) }
    }

    /// Messages in the OpenAI chat format: a JSON array of objects with `role`, `content`
    /// (a string, a list of `{"type": "text", "text": ...}` parts, or null), and optionally
    /// `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments"}}]`, the
    /// arguments a JSON string or an object), `tool_call_id` and `name`.
    pub fn list_from_json(text: &str) -> Result<Vec<Message>, String> {
        Message::list_from_value(&JsonValue::parse(text)?)
    }

    /// `list_from_json` of a parsed value.
    pub fn list_from_value(v: &JsonValue) -> Result<Vec<Message>, String> {
        let v = &v.0;
        if v.kind() != ValueKind::Seq {
            return Err("messages: expected a JSON array".into());
        }
        let mut out = Vec::new();
        for (i, m) in iter(v).enumerate() {
            out.push(message_from_value(&m).map_err(|e| format!("messages[{i}]: {e}"))?);
        }
        Ok(out)
    }
}

fn iter(v: &Value) -> impl Iterator<Item = Value> {
    v.try_iter().into_iter().flatten()
}

fn get(v: &Value, key: &str) -> Option<Value> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined() && !x.is_none())
}

fn get_str(v: &Value, key: &str) -> Result<Option<String>, String> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => match x.as_str() {
            Some(s) => Ok(Some(s.to_string())),
            None => Err(format!("`{key}` is not a string")),
        },
    }
}

fn message_from_value(m: &Value) -> Result<Message, String> {
    if m.kind() != ValueKind::Map {
        return Err("not an object".into());
    }
    let role = get_str(m, "role")?.ok_or("no `role`")?;
    let content = match get(m, "content") {
        None => Content::Text(String::new()),
        Some(c) if c.kind() == ValueKind::String => Content::Text(c.as_str().unwrap_or("").to_string()),
        Some(c) if c.kind() == ValueKind::Seq => {
            let mut parts = Vec::new();
            for p in iter(&c) {
                match get_str(&p, "type")?.as_deref() {
                    Some("text") => parts.push(get_str(&p, "text")?.unwrap_or_default()),
                    Some(t) => return Err(format!("content part of type {t:?}: only text parts are supported")),
                    None => return Err("a content part has no `type`".into()),
                }
            }
            Content::Parts(parts)
        }
        Some(_) => return Err("`content` is neither a string nor a list of parts".into()),
    };
    let mut tool_calls = Vec::new();
    if let Some(calls) = get(m, "tool_calls") {
        for c in iter(&calls) {
            let f = get(&c, "function").unwrap_or_else(|| c.clone());
            let name = get_str(&f, "name")?.ok_or("a tool call has no function name")?;
            let arguments = match get(&f, "arguments") {
                None => "{}".to_string(),
                Some(a) => match a.as_str() {
                    Some(s) => s.to_string(),
                    None => to_json(&a, &JsonStyle::compact())?,
                },
            };
            tool_calls.push(ToolCall { id: get_str(&c, "id")?, name, arguments });
        }
    }
    Ok(Message { role, content, tool_calls, tool_call_id: get_str(m, "tool_call_id")?, name: get_str(m, "name")? })
}

/// A JSON value with its object keys in their written order (as Python keeps them), for
/// tool definitions and extra template variables.
#[derive(Clone, Debug)]
pub struct JsonValue(Value);

impl JsonValue {
    pub fn parse(text: &str) -> Result<JsonValue, String> {
        serde_json::from_str::<Value>(text).map(JsonValue).map_err(|e| format!("invalid JSON: {e}"))
    }

    /// Compact JSON text (`{"a":1}`), keys in order.
    pub fn to_json(&self) -> String {
        to_json(&self.0, &JsonStyle::compact()).unwrap_or_default()
    }

    /// The member `key` of an object (absent and null are `None`).
    pub fn get(&self, key: &str) -> Option<JsonValue> {
        (self.0.kind() == ValueKind::Map).then(|| get(&self.0, key)).flatten().map(JsonValue)
    }

    /// Element `i` of an array.
    pub fn at(&self, i: usize) -> Option<JsonValue> {
        (self.0.kind() == ValueKind::Seq)
            .then(|| self.0.get_item_by_index(i).ok())
            .flatten()
            .filter(|v| !v.is_undefined())
            .map(JsonValue)
    }

    /// Elements of an array, members of an object (0 for anything else).
    pub fn len(&self) -> usize {
        match self.0.kind() {
            ValueKind::Seq | ValueKind::Map => self.0.len().unwrap_or(0),
            _ => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_str(&self) -> Option<&str> {
        self.0.as_str()
    }

    pub fn as_bool(&self) -> Option<bool> {
        (self.0.kind() == ValueKind::Bool).then(|| self.0.is_true())
    }

    pub fn as_u64(&self) -> Option<u64> {
        u64::try_from(self.0.clone()).ok().filter(|_| self.0.is_integer())
    }
}

impl From<bool> for JsonValue {
    fn from(b: bool) -> JsonValue {
        JsonValue(Value::from(b))
    }
}

impl From<&str> for JsonValue {
    fn from(s: &str) -> JsonValue {
        JsonValue(Value::from(s))
    }
}

/// How to render a conversation.
#[derive(Clone, Debug)]
pub struct RenderOptions {
    /// End with the opening of an assistant turn (what generation needs).
    pub add_generation_prompt: bool,
    /// Tool definitions: a JSON array (OpenAI's `[{"type": "function", "function": {...}}]`).
    pub tools: Option<JsonValue>,
    /// Passed as `enable_thinking` when set (Qwen3-style templates read it); llama.cpp's
    /// server passes `true` unless told otherwise, and so does the default here.
    pub enable_thinking: Option<bool>,
    /// More variables for the template.
    pub extra: Vec<(String, JsonValue)>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions { add_generation_prompt: true, tools: None, enable_thinking: Some(true), extra: Vec::new() }
    }
}

/// What a template was found to understand (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub string_content: bool,
    pub typed_content: bool,
    pub system_role: bool,
    pub object_arguments: bool,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    source: String,
    tool_use: Option<String>,
    bos_token: String,
    eos_token: String,
    caps: Caps,
}

const MAIN: &str = "chat_template";
const TOOL_USE: &str = "chat_template.tool_use";

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).field("caps", &self.caps).finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` says where it came from (errors name it); `bos_token` and
    /// `eos_token` are the texts the template sees under those names.
    pub fn new(
        source: &str,
        origin: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        ChatTemplate::with_tool_use(source, None, origin, bos_token, eos_token)
    }

    /// Like `new`, with a second template used when tools are given.
    pub fn with_tool_use(
        source: &str,
        tool_use: Option<&str>,
        origin: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut env = environment();
        env.add_template_owned(MAIN, rewrite_generation_tags(source)).map_err(|e| template_error(origin, &e))?;
        if let Some(t) = tool_use {
            env.add_template_owned(TOOL_USE, rewrite_generation_tags(t)).map_err(|e| template_error(origin, &e))?;
        }
        let mut t = ChatTemplate {
            env,
            origin: origin.to_string(),
            source: source.to_string(),
            tool_use: tool_use.map(str::to_string),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            caps: Caps { string_content: true, typed_content: false, system_role: true, object_arguments: false },
        };
        t.caps = t.probe();
        Ok(t)
    }

    /// llama.cpp's ChatML template, for models that have none.
    pub fn chatml(bos_token: &str, eos_token: &str) -> ChatTemplate {
        ChatTemplate::new(CHATML, "built-in ChatML", bos_token, eos_token).expect("the built-in template compiles")
    }

    /// The template in a GGUF file's metadata, if it has one.
    pub fn from_gguf(
        f: &GgufFile,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let origin = format!("{}: GGUF metadata `tokenizer.chat_template`", f.path.display());
        let read = |key: &str| -> Result<Option<&str>, ChatTemplateError> {
            match f.get(key) {
                None => Ok(None),
                Some(v) => v.as_str().map(Some).ok_or_else(|| ChatTemplateError {
                    origin: origin.clone(),
                    line: None,
                    message: format!("metadata key `{key}` is not a string"),
                }),
            }
        };
        let Some(main) = read("tokenizer.chat_template")? else { return Ok(None) };
        let tool_use = read("tokenizer.chat_template.tool_use")?;
        ChatTemplate::with_tool_use(main, tool_use, &origin, bos_token, eos_token).map(Some)
    }

    /// The template of a Hugging Face model directory: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template`. BOS and EOS texts come from
    /// `tokenizer_config.json` (`bos_token`, `eos_token`).
    pub fn from_hf_dir(dir: &Path) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<Value> = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_error(&cfg_path, e.to_string()))?;
            Some(serde_json::from_str(&text).map_err(|e| file_error(&cfg_path, format!("invalid JSON: {e}")))?)
        } else {
            None
        };
        let token_text = |key: &str| -> String {
            let Some(v) = cfg.as_ref().and_then(|c| get(c, key)) else { return String::new() };
            match v.as_str() {
                Some(s) => s.to_string(),
                None => get(&v, "content").and_then(|c| c.as_str().map(str::to_string)).unwrap_or_default(),
            }
        };
        let (bos, eos) = (token_text("bos_token"), token_text("eos_token"));
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let src = std::fs::read_to_string(&jinja).map_err(|e| file_error(&jinja, e.to_string()))?;
            return ChatTemplate::new(&src, &jinja.display().to_string(), &bos, &eos).map(Some);
        }
        let Some(cfg) = cfg else { return Ok(None) };
        let origin = format!("{}: `chat_template`", cfg_path.display());
        let Some(t) = get(&cfg, "chat_template") else { return Ok(None) };
        if let Some(s) = t.as_str() {
            return ChatTemplate::new(s, &origin, &bos, &eos).map(Some);
        }
        if t.kind() == ValueKind::Seq {
            let mut named = Vec::new();
            for entry in iter(&t) {
                let name = get(&entry, "name").and_then(|n| n.as_str().map(str::to_string));
                let src = get(&entry, "template").and_then(|n| n.as_str().map(str::to_string));
                match (name, src) {
                    (Some(n), Some(s)) => named.push((n, s)),
                    _ => {
                        return Err(file_error(
                            &cfg_path,
                            "`chat_template` lists an entry without `name` and `template`",
                        ))
                    }
                }
            }
            let find = |n: &str| named.iter().find(|(k, _)| k == n).map(|(_, s)| s.as_str());
            let Some(main) = find("default") else {
                let names: Vec<&str> = named.iter().map(|(k, _)| k.as_str()).collect();
                return Err(file_error(
                    &cfg_path,
                    format!("`chat_template` has no template named \"default\" (it has {names:?})"),
                ));
            };
            let origin = format!("{origin} \"default\"");
            return ChatTemplate::with_tool_use(main, find("tool_use"), &origin, &bos, &eos).map(Some);
        }
        Err(file_error(&cfg_path, "`chat_template` is neither a string nor a list of named templates"))
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// The end-of-turn texts (`END_OF_TURN_TEXTS`) this template writes.
    pub fn end_of_turn_texts(&self) -> Vec<&'static str> {
        let all = [Some(self.source.as_str()), self.tool_use.as_deref()];
        END_OF_TURN_TEXTS.iter().copied().filter(|t| all.iter().flatten().any(|s| s.contains(t))).collect()
    }

    /// The prompt text of `messages`.
    pub fn render(&self, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatTemplateError> {
        let name = if opts.tools.is_some() && self.tool_use.is_some() { TOOL_USE } else { MAIN };
        let ctx = self.context(self.caps, messages, opts);
        self.render_raw(name, ctx).map_err(|e| template_error(&self.origin, &e))
    }

    fn render_raw(&self, name: &str, ctx: Value) -> Result<String, Error> {
        self.env.get_template(name)?.render(ctx)
    }

    fn context(&self, caps: Caps, messages: &[Message], opts: &RenderOptions) -> Value {
        let msgs: Vec<Value> = adapt(caps, messages).iter().map(|m| message_value(caps, m)).collect();
        let mut vars: Vec<(&str, Value)> = vec![
            ("messages", Value::from(msgs)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
            ("add_generation_prompt", Value::from(opts.add_generation_prompt)),
            ("date_string", Value::from(strftime_local("%d %b %Y"))),
            ("datetime", Value::from(strftime_local("%b %d %Y"))),
        ];
        if let Some(t) = &opts.tools {
            vars.push(("tools", t.0.clone()));
        }
        if let Some(b) = opts.enable_thinking {
            vars.push(("enable_thinking", Value::from(b)));
        }
        for (k, v) in &opts.extra {
            vars.retain(|(n, _)| n != k);
            vars.push((k.as_str(), v.0.clone()));
        }
        Value::from_pairs(vars)
    }

    /// Finds out what the template understands by rendering small conversations with a
    /// marker (messages go through unchanged while probing).
    fn probe(&self) -> Caps {
        const MARK: &str = "@@SLUICE-PROBE@@";
        let neutral = Caps { string_content: true, typed_content: true, system_role: true, object_arguments: true };
        let render = |msgs: Vec<Message>, tools: bool| -> Option<String> {
            let opts = RenderOptions {
                tools: tools.then(|| JsonValue::parse(PROBE_TOOLS).expect("valid JSON")),
                ..Default::default()
            };
            self.render_raw(MAIN, self.context(neutral, &msgs, &opts)).ok()
        };
        let string_content = render(vec![Message::user(MARK)], false).is_some_and(|o| o.contains(MARK));
        let parts = Message { content: Content::Parts(vec![MARK.to_string()]), ..Message::user("") };
        // The part's text printed by itself, not the list printed whole.
        let typed_content = render(vec![parts], false)
            .is_some_and(|o| o.contains(MARK) && !o.contains("'type'") && !o.contains("\"type\""));
        // The system role is ignored when its text is not printed, or refused when the
        // template fails with it but not without it.
        let system_role = match render(vec![Message::system(MARK), Message::user("u")], false) {
            Some(o) => o.contains(MARK),
            None => render(vec![Message::user("u")], false).is_none(),
        };
        let call = ToolCall {
            id: Some("call00001".into()),
            name: "tool1".into(),
            arguments: format!("{{\"arg\": \"{MARK}\"}}"),
        };
        let conv = vec![
            Message::user("User message"),
            Message { tool_calls: vec![call], ..Message::assistant("") },
            Message::tool("Tool response", Some("call00001".into())),
            Message::assistant("The tool response was 'tool response'"),
            Message::user("User message"),
        ];
        let object_arguments = render(conv, true).is_some_and(|o| o.contains(MARK));
        Caps { string_content: string_content || !typed_content, typed_content, system_role, object_arguments }
    }
}

/// The messages as a template with `caps` wants them (system role, content shape).
fn adapt(caps: Caps, messages: &[Message]) -> Vec<Message> {
    let mut msgs = messages.to_vec();
    if !caps.system_role && msgs.first().is_some_and(|m| m.role == "system") {
        let sys = msgs.remove(0);
        if let Some(next) = msgs.first_mut() {
            next.content = Content::Text(format!("{}\n{}", sys.content.text(), next.content.text()));
        }
    }
    let only_string = caps.string_content && !caps.typed_content;
    let only_typed = caps.typed_content && !caps.string_content;
    for m in &mut msgs {
        match &m.content {
            Content::Parts(_) if only_string => m.content = Content::Text(m.content.text()),
            Content::Text(s) if only_typed => m.content = Content::Parts(vec![s.clone()]),
            _ => {}
        }
    }
    msgs
}

fn message_value(caps: Caps, m: &Message) -> Value {
    let content = match &m.content {
        Content::Text(s) => Value::from(s.as_str()),
        Content::Parts(p) => Value::from(
            p.iter()
                .map(|t| Value::from_pairs([("type", Value::from("text")), ("text", Value::from(t.as_str()))]))
                .collect::<Vec<_>>(),
        ),
    };
    let mut kv: Vec<(&str, Value)> = vec![("role", Value::from(m.role.as_str())), ("content", content)];
    if let Some(n) = &m.name {
        kv.push(("name", Value::from(n.as_str())));
    }
    if let Some(id) = &m.tool_call_id {
        kv.push(("tool_call_id", Value::from(id.as_str())));
    }
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                let args = if caps.object_arguments {
                    serde_json::from_str::<Value>(&c.arguments).unwrap_or_else(|_| Value::from(c.arguments.as_str()))
                } else {
                    Value::from(c.arguments.as_str())
                };
                let function = Value::from_pairs([("name", Value::from(c.name.as_str())), ("arguments", args)]);
                let mut call = vec![("type", Value::from("function")), ("function", function)];
                if let Some(id) = &c.id {
                    call.push(("id", Value::from(id.as_str())));
                }
                Value::from_pairs(call)
            })
            .collect();
        kv.push(("tool_calls", Value::from(calls)));
    }
    Value::from_pairs(kv)
}

const PROBE_TOOLS: &str = r#"[{"name": "tool", "type": "function", "function": {"name": "tool1", "description": "Tool description", "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}}, "required": ["arg"]}}}]"#;

fn file_error(path: &Path, msg: impl Into<String>) -> ChatTemplateError {
    ChatTemplateError { origin: path.display().to_string(), line: None, message: msg.into() }
}

fn template_error(origin: &str, e: &Error) -> ChatTemplateError {
    let mut message = match (e.kind(), e.detail()) {
        (_, Some(d)) if d.starts_with(RAISED) => d.to_string(),
        (k, Some(d)) => format!("{k}: {d}"),
        (k, None) => k.to_string(),
    };
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let _ = write!(message, ": {s}");
        src = s.source();
    }
    ChatTemplateError { origin: origin.to_string(), line: e.line(), message }
}

const RAISED: &str = "the template raised an exception: ";

/// transformers' `{% generation %}...{% endgeneration %}` marks what the assistant wrote (for
/// training masks) and renders its body as is: here it becomes `{% if true %}...{% endif %}`,
/// a block tag like it, so whitespace control and line numbers stay the same.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i + 2]);
        rest = &rest[i + 2..];
        let ctl = rest.len() - rest.trim_start_matches(['-', '+']).len();
        let ctl = ctl.min(1);
        let after_ctl = &rest[ctl..];
        let word_start = after_ctl.len() - after_ctl.trim_start().len();
        let word = &after_ctl[word_start..];
        let end = word.find(|c: char| !c.is_ascii_alphanumeric() && c != '_').unwrap_or(word.len());
        let replacement = match &word[..end] {
            "generation" => "if true",
            "endgeneration" => "endif",
            _ => continue,
        };
        out.push_str(&rest[..ctl + word_start]);
        out.push_str(replacement);
        rest = &word[end..];
    }
    out.push_str(rest);
    out
}

/// Jinja2's `indent(width=4, first=False, blank=False)`: lines after the first are indented
/// (the first too with `first`; blank lines only with `blank`), a trailing newline kept.
fn indent_filter(
    s: String,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = first.or(kwargs.get::<Option<bool>>("first")?);
    let blank = blank.or(kwargs.get::<Option<bool>>("blank")?);
    kwargs.assert_all_used()?;
    let pad = match width {
        None => "    ".to_string(),
        Some(w) => match w.as_str() {
            Some(p) => p.to_string(),
            None => " ".repeat(usize::try_from(w)?),
        },
    };
    let (first, blank) = (first.unwrap_or(false), blank.unwrap_or(false));
    // Python's splitlines of s + "\n": a trailing newline leaves an empty last line.
    let with_nl = format!("{s}\n");
    let lines: Vec<&str> = with_nl.split_terminator('\n').collect();
    let mut out = String::with_capacity(s.len() + lines.len() * pad.len());
    if first {
        out.push_str(&pad);
    }
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(&pad);
            }
        }
        out.push_str(line);
    }
    Ok(out)
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let mut syntax = minijinja::syntax::SyntaxConfig::builder();
    syntax.trim_blocks(true).lstrip_blocks(true).keep_trailing_newline(false);
    env.set_syntax(syntax.build().expect("the default delimiters are valid"));
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson_filter);
    env.add_filter("indent", indent_filter);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
    });
    env.add_function("strftime_now", |fmt: String| strftime_local(&fmt));
    env
}

/// Values print as Python prints them: `None`, `True`, `[1, 'a']`, `{'k': 'v'}`.
fn python_formatter(out: &mut minijinja::Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            out.write_str(&py_repr(value))?;
            Ok(())
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a value.
fn py_repr(v: &Value) -> String {
    let mut s = String::new();
    write_repr(&mut s, v);
    s
}

fn write_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_text(v, false)),
        ValueKind::String => out.push_str(&py_str_repr(v.as_str().unwrap_or(""))),
        ValueKind::Map => {
            out.push('{');
            for (i, k) in iter(v).enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &k);
                out.push_str(": ");
                write_repr(out, &v.get_item(&k).unwrap_or_default());
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, x) in iter(v).enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &x);
            }
            out.push(']');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

fn py_str_repr(s: &str) -> String {
    let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(q);
    out
}

/// A number as Python writes it: integers as they are, floats as `repr(float)` (`1.0`,
/// `1e-05`, `1e+16`); in JSON, non-finite floats are `NaN`/`Infinity`.
fn number_text(v: &Value, json: bool) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(x) => py_float(x, json),
        Err(_) => v.to_string(),
    }
}

fn py_float(x: f64, json: bool) -> String {
    if x.is_nan() {
        return if json { "NaN" } else { "nan" }.into();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 { format!("-{s}") } else { s.into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest digits that read back as x, and the decimal exponent.
    let e = format!("{:e}", x.abs());
    let (mant, exp) = e.split_once('e').expect("exponent form");
    let exp: i32 = exp.parse().expect("an exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if x < 0.0 {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// How to write JSON (Python's `json.dumps` parameters).
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn compact() -> JsonStyle {
        JsonStyle { indent: None, item_sep: ",".into(), key_sep: ":".into(), sort_keys: false, ensure_ascii: false }
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson_filter(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let seps: Option<Value> = kwargs.get("separators")?;
    let (mut item_sep, mut key_sep) =
        (if indent.is_some() { ",".to_string() } else { ", ".to_string() }, ": ".to_string());
    if let Some(s) = seps.filter(|s| !s.is_none() && !s.is_undefined()) {
        let parts: Vec<Value> = iter(&s).collect();
        if parts.len() != 2 {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair of strings"));
        }
        item_sep = parts[0].as_str().unwrap_or(",").to_string();
        key_sep = parts[1].as_str().unwrap_or(":").to_string();
    }
    kwargs.assert_all_used()?;
    let style = JsonStyle { indent, item_sep, key_sep, sort_keys, ensure_ascii };
    to_json(value, &style).map(Value::from).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
}

fn to_json(v: &Value, style: &JsonStyle) -> Result<String, String> {
    let mut out = String::new();
    write_json(&mut out, v, style, 0)?;
    Ok(out)
}

fn newline_indent(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), String> {
    if depth > 512 {
        return Err("tojson: nesting too deep".into());
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_text(v, true)),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Bytes => {
            write_json_str(out, &String::from_utf8_lossy(v.as_bytes().unwrap_or(&[])), style.ensure_ascii)
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = iter(v).collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by_key(json_key);
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(out, style, depth + 1);
                write_json_str(out, &json_key(k), style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &v.get_item(k).unwrap_or_default(), style, depth + 1)?;
            }
            newline_indent(out, style, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = iter(v).collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(out, style, depth + 1);
                write_json(out, x, style, depth + 1)?;
            }
            newline_indent(out, style, depth);
            out.push(']');
        }
        ValueKind::Invalid => return Err(format!("tojson: {v}")),
        _ => write_json_str(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// A key as Python's `json.dumps` writes it.
fn json_key(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => number_text(k, true),
        _ => k.to_string(),
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The local time formatted by C's `strftime` (what Python's `strftime` calls).
fn strftime_local(fmt: &str) -> String {
    let Ok(cfmt) = std::ffi::CString::new(fmt) else { return String::new() };
    // SAFETY: `time` and `localtime_r` write only into the locals given; `strftime` writes at
    // most `buf.len()` bytes into `buf` and returns how many it wrote.
    unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return String::new();
        }
        let mut buf = vec![0u8; 256 + 4 * fmt.len()];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm);
        buf.truncate(n);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// The function names a request's `tools` list offers (`[{"type": "function", "function":
/// {"name": ...}}]`, or `[{"name": ...}]`), in order.
pub fn tool_names(tools: &JsonValue) -> Vec<String> {
    (0..tools.len())
        .filter_map(|i| {
            let t = tools.at(i)?;
            let name = t.get("function").and_then(|f| f.get("name")).or_else(|| t.get("name"))?;
            name.0.as_str().map(str::to_string)
        })
        .collect()
}

/// Tool calls in what a model writes when it was offered the tools named `offered`: the
/// Qwen/Hermes tagged format (`parse_tool_calls`), or — what small models often write instead
/// — the bare call objects themselves at the very start of the reply (`{"name": "get_weather",
/// "arguments": {...}}`, one or more, any whitespace between). A bare object counts only when
/// it names an offered tool; reading stops at the first JSON value that is not such a call,
/// and everything from there on is the text.
pub fn parse_tool_calls_offered(text: &str, offered: &[String]) -> (String, Vec<ToolCall>) {
    let (rest, calls) = parse_tool_calls(text);
    if !calls.is_empty() || offered.is_empty() {
        return (rest, calls);
    }
    let lead = text.len() - text.trim_start().len();
    if !text[lead..].starts_with('{') {
        return (text.to_string(), calls);
    }
    let mut calls = Vec::new();
    let mut end = lead;
    let mut values = serde_json::Deserializer::from_str(&text[lead..]).into_iter::<Value>();
    while let Some(Ok(v)) = values.next() {
        let call = (v.kind() == ValueKind::Map).then(|| call_of(&v)).flatten();
        match call {
            Some(c) if offered.contains(&c.name) => calls.push(c),
            _ => break,
        }
        end = lead + values.byte_offset();
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    (text[end..].trim().to_string(), calls)
}

/// Tool calls written in the Qwen/Hermes format (`<tool_call>{"name": ..., "arguments":
/// {...}}</tool_call>`, any whitespace around the JSON, any number of calls), and the text
/// around them with the calls taken out and the ends trimmed. A block whose JSON does not
/// parse, or that names no function, stays in the text. A block cut off by the end of the
/// text (generation stopped at its closing tag) is read to the end.
pub fn parse_tool_calls(text: &str) -> (String, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut pos = 0;
    while let Some(rel) = text[pos..].find(OPEN) {
        let start = pos + rel;
        let body_start = start + OPEN.len();
        let (body_end, end) = match text[body_start..].find(CLOSE) {
            Some(r) => (body_start + r, body_start + r + CLOSE.len()),
            None => (text.len(), text.len()),
        };
        match parse_call(&text[body_start..body_end]) {
            Some(c) => {
                rest.push_str(&text[pos..start]);
                calls.push(c);
            }
            None => rest.push_str(&text[pos..end]),
        }
        pos = end;
    }
    rest.push_str(&text[pos..]);
    let rest = if calls.is_empty() { text.to_string() } else { rest.trim().to_string() };
    (rest, calls)
}

fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    if v.kind() != ValueKind::Map {
        return None;
    }
    call_of(&v)
}

/// A call object: `{"name": ..., "arguments" (or "parameters"): {...} or "..."}`.
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = get(v, "name")?.as_str()?.to_string();
    let arguments = match get(v, "arguments").or_else(|| get(v, "parameters")) {
        None => "{}".to_string(),
        Some(a) => match a.as_str() {
            Some(s) => s.to_string(),
            None => to_json(&a, &JsonStyle::compact()).ok()?,
        },
    };
    Some(ToolCall { id: None, name, arguments })
}
