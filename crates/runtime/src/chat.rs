//! A multi-turn chat: the conversation so far, rendered with the model's chat template on
//! every turn, and the sequence state kept between turns so that only what a turn adds is
//! run (see `generate_cached`).

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::{generate_cached, GenerateOptions, Generation, PromptCache, StopReason};
use sluice_formats::chat_template::{parse_tool_calls_offered, tool_names, Message, RenderOptions, ToolCall};
use sluice_formats::TextStream;
use sluice_model::SeqState;

/// One assistant turn.
#[derive(Clone, Debug)]
pub struct Turn {
    /// What the assistant said (end-of-turn marker and tool calls taken out).
    pub text: String,
    /// Tool calls it made (when tools were given).
    pub tool_calls: Vec<ToolCall>,
    pub generation: Generation,
}

pub struct ChatSession<'e> {
    engine: &'e Engine,
    /// The conversation so far.
    pub messages: Vec<Message>,
    system: Option<String>,
    /// Template variables (`add_generation_prompt` is always set).
    pub render: RenderOptions,
    pub options: GenerateOptions,
    kv: SeqState,
    cache: PromptCache,
    /// End-of-turn texts that are not single tokens (a template written for another
    /// vocabulary): the reply stops where one appears.
    stop_texts: Vec<&'static str>,
}

impl<'e> ChatSession<'e> {
    /// A conversation with the engine's chat template, starting with `system` if given.
    /// `options.stop_tokens` is extended with the template's end-of-turn tokens.
    pub fn new(engine: &'e Engine, system: Option<String>, mut options: GenerateOptions) -> Result<ChatSession<'e>> {
        let template = engine.chat_template()?;
        for t in engine.chat_stop_tokens() {
            if !options.stop_tokens.contains(&t) {
                options.stop_tokens.push(t);
            }
        }
        let tok = engine.tokenizer()?;
        let stop_texts = template.end_of_turn_texts().into_iter().filter(|t| tok.token_id(t).is_none()).collect();
        let mut s = ChatSession {
            engine,
            messages: Vec::new(),
            system,
            render: RenderOptions::default(),
            options,
            kv: engine.new_state(),
            cache: PromptCache::new(),
            stop_texts,
        };
        s.reset();
        Ok(s)
    }

    /// Forgets the conversation (the system message stays). The sequence state is kept: the
    /// next turn reuses what the new prompt shares with it.
    pub fn reset(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(Message::system(s.clone()));
        }
    }

    /// The prompt tokens of the conversation so far, ready for the assistant's turn.
    pub fn prompt_tokens(&self) -> Result<Vec<u32>> {
        let opts = RenderOptions { add_generation_prompt: true, ..self.render.clone() };
        self.engine.chat_tokens(&self.messages, &opts)
    }

    /// Adds `message` (a user turn, or a tool's result) and generates the assistant's reply.
    /// `on_text` sees the reply's text as it comes and returns false to stop it. The reply
    /// joins the conversation; on an error the conversation is as it was.
    pub fn send(&mut self, message: Message, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Turn> {
        self.messages.push(message);
        let r = self.reply(on_text);
        if r.is_err() {
            self.messages.pop();
        }
        r
    }

    /// `send` of a user message.
    pub fn say(&mut self, text: &str, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Turn> {
        self.send(Message::user(text), on_text)
    }

    fn reply(&mut self, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Turn> {
        let prompt = self.prompt_tokens()?;
        let tok = self.engine.tokenizer()?;
        let mut stream = TextStream::new();
        let mut held = StopText::new(&self.stop_texts);
        let (mut cancelled, mut stopped_by_text) = (false, false);
        let stop_tokens = &self.options.stop_tokens;
        let eos = &self.engine.eos;
        let mut on_token = |id: u32| {
            if stop_tokens.contains(&id) || eos.contains(&id) {
                return true;
            }
            let (emit, stop) = held.push(&stream.push(tok, id));
            if !emit.is_empty() && !on_text(&emit) {
                cancelled = true;
                return false;
            }
            stopped_by_text = stop;
            !stop
        };
        let mut g =
            generate_cached(self.engine, &mut self.kv, &mut self.cache, &prompt, &self.options, &mut on_token, None)?;
        if stopped_by_text {
            g.stop = StopReason::Eos;
        }
        if !cancelled {
            let (emit, _) = held.push(&stream.finish(tok));
            let rest = emit + &held.flush();
            if !rest.is_empty() {
                on_text(&rest);
            }
        }
        let mut reply: Vec<u32> = g.tokens.clone();
        if reply.last().is_some_and(|t| self.options.stop_tokens.contains(t) || self.engine.eos.contains(t)) {
            reply.pop();
        }
        let mut text = tok.decode(&reply, true);
        if let Some(cut) = self.stop_texts.iter().filter_map(|s| text.find(s)).min() {
            text.truncate(cut);
        }
        let (text, tool_calls) = match &self.render.tools {
            Some(t) => parse_tool_calls_offered(&text, &tool_names(t)),
            None => (text, Vec::new()),
        };
        self.messages.push(Message { tool_calls: tool_calls.clone(), ..Message::assistant(text.clone()) });
        Ok(Turn { text, tool_calls, generation: g })
    }

    /// Tokens whose state is held (prompt and reply of the last turn).
    pub fn cached_tokens(&self) -> usize {
        self.cache.tokens().len()
    }
}

/// Holds back streamed text that may be the start of a stop text, and finds stop texts.
struct StopText<'a> {
    stops: &'a [&'static str],
    held: String,
    stopped: bool,
}

impl<'a> StopText<'a> {
    fn new(stops: &'a [&'static str]) -> StopText<'a> {
        StopText { stops, held: String::new(), stopped: false }
    }

    /// Takes new text; returns what can be shown and whether a stop text was reached.
    fn push(&mut self, delta: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(delta);
        if let Some(cut) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.stopped = true;
            let emit = self.held[..cut].to_string();
            self.held.clear();
            return (emit, true);
        }
        // Keep the longest tail that begins some stop text.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|n| s.is_char_boundary(*n)).map(move |n| &s[..n]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (emit, false)
    }

    /// What is still held at the end.
    fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

impl From<sluice_formats::ChatTemplateError> for RuntimeError {
    fn from(e: sluice_formats::ChatTemplateError) -> RuntimeError {
        RuntimeError::Input(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::StopText;

    #[test]
    fn stop_texts_are_held_back_until_they_are_known() {
        let stops = ["<|im_end|>"];
        let mut s = StopText::new(&stops);
        assert_eq!(s.push("Hello <|im"), ("Hello ".to_string(), false));
        assert_eq!(s.push("_e"), (String::new(), false));
        assert_eq!(s.push("nd|>\nmore"), (String::new(), true));
        assert_eq!(s.flush(), "");
        let mut s = StopText::new(&stops);
        assert_eq!(s.push("a <|i"), ("a ".to_string(), false));
        assert_eq!(s.push("x"), ("<|ix".to_string(), false));
        assert_eq!(s.push("<"), (String::new(), false));
        assert_eq!(s.flush(), "<");
    }
}
