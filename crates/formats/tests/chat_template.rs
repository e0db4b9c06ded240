//! Chat templates rendered as Python's Jinja2 renders them for transformers and llama.cpp's
//! server: the Python behaviour real templates rely on, where templates come from, what
//! errors say, and tool calls read back out of generated text. The rendered prompts of the
//! real models' own templates are checked against llama-server's records (tests/chat).

use sluice_formats::chat_template::{
    parse_tool_calls, parse_tool_calls_offered, tool_names, Content, JsonValue, CHATML,
};
use sluice_formats::{ChatTemplate, Message, RenderOptions, ToolCall};
use std::path::PathBuf;

fn render(src: &str, messages: &[Message], opts: &RenderOptions) -> String {
    ChatTemplate::new(src, "test", "<s>", "</s>").unwrap().render(messages, opts).unwrap()
}

/// Renders `src` with no messages.
fn eval(src: &str) -> String {
    render(src, &[], &RenderOptions::default())
}

fn tools_json() -> JsonValue {
    JsonValue::parse(r#"[{"type": "function", "function": {"name": "f", "description": "é \"q\"", "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "number", "default": 0.5}}}}}]"#).unwrap()
}

#[test]
fn python_values_print_as_python_prints_them() {
    assert_eq!(eval("{{ none }}|{{ true }}|{{ false }}"), "None|True|False");
    assert_eq!(eval("{{ [1, 'a', none, true] }}"), "[1, 'a', None, True]");
    assert_eq!(eval("{{ {'k': \"it's\"} }}"), "{'k': \"it's\"}");
    assert_eq!(eval("{{ 1.0 }} {{ 2.5 }} {{ 3 }}"), "1.0 2.5 3");
}

#[test]
fn tojson_writes_what_json_dumps_writes() {
    let opts = RenderOptions { tools: Some(tools_json()), ..Default::default() };
    // Key order as written, ", " and ": " separators, non-ASCII kept.
    assert_eq!(
        render("{{ tools[0] | tojson }}", &[], &opts),
        r#"{"type": "function", "function": {"name": "f", "description": "é \"q\"", "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "number", "default": 0.5}}}}}"#
    );
    assert_eq!(
        render("{{ tools[0].function.parameters.properties | tojson(indent=2) }}", &[], &opts),
        "{\n  \"b\": {\n    \"type\": \"integer\"\n  },\n  \"a\": {\n    \"type\": \"number\",\n    \"default\": 0.5\n  }\n}"
    );
    assert_eq!(
        render(
            "{{ tools[0].function.parameters.properties | tojson(sort_keys=true, separators=(',', ':')) }}",
            &[],
            &opts
        ),
        r#"{"a":{"default":0.5,"type":"number"},"b":{"type":"integer"}}"#
    );
    assert_eq!(
        render("{{ tools[0].function.description | tojson(ensure_ascii=true) }}", &[], &opts),
        r#""\u00e9 \"q\"""#
    );
    assert_eq!(eval("{{ [] | tojson(indent=4) }}{{ {} | tojson }}"), "[]{}");
    // Floats as Python's repr; no HTML escaping.
    assert_eq!(
        eval("{{ [1.0, 1e-05, 1e16, 0.0001, 123.456, -2.0] | tojson }}"),
        "[1.0, 1e-05, 1e+16, 0.0001, 123.456, -2.0]"
    );
    assert_eq!(eval("{{ '<a & b>\n\t\u{1}' | tojson }}"), r#""<a & b>\n\t\u0001""#);
    assert_eq!(eval("{{ none | tojson }} {{ true | tojson }}"), "null true");
}

#[test]
fn jinja2_features_real_templates_use() {
    // trim_blocks and lstrip_blocks: a block tag's line leaves no whitespace behind.
    assert_eq!(eval("{% if true %}\n  a\n{% endif %}\n"), "  a\n");
    assert_eq!(eval("  {% for i in [1,2] %}\n{{ i }}\n  {% endfor %}"), "1\n2\n");
    // Loop controls, namespace, loop variables, slicing, tests.
    assert_eq!(eval("{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"), "013");
    assert_eq!(
        eval("{% set ns = namespace(n=0) %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
        "6"
    );
    assert_eq!(
        eval("{% for x in ['a', 'b', 'c'][::-1] %}{{ loop.index0 }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}"),
        "0c,1b,2a"
    );
    assert_eq!(eval("{{ 'x' is string }}{{ {} is mapping }}{{ none is none }}{{ y is defined }}"), "TrueTrueTrueFalse");
    // Python string and dict methods.
    assert_eq!(eval("{{ '  hi \n'.strip() }}|{{ 'a</think>b'.split('</think>')[-1].lstrip('\n') }}|{{ 'xy'.startswith('x') }}|{{ 'xy'.endswith(('q', 'y')) }}"), "hi|b|True|True");
    assert_eq!(
        eval("{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}{{ 'a-b'.replace('-', '+') }}{{ '{} {}'.format(1, 2) }}"),
        "ABab".to_string() + "a+b1 2"
    );
    assert_eq!(eval("{% set d = {'a': 1, 'b': 2} %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('c', 9) }}{{ d.keys() | list | length }}"), "a=1;b=2;92");
    // strftime_now: the local date through C's strftime.
    let year = eval("{{ strftime_now('%Y') }}");
    assert!(year.len() == 4 && year.chars().all(|c| c.is_ascii_digit()), "{year}");
    // The template's own variables.
    assert_eq!(
        eval("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ date_string is defined }}"),
        "<s>|</s>|True|True|True"
    );
    let opts = RenderOptions { enable_thinking: Some(false), add_generation_prompt: false, ..Default::default() };
    assert_eq!(render("{{ add_generation_prompt }} {{ enable_thinking }}", &[], &opts), "False False");
    let opts = RenderOptions {
        extra: vec![("custom".into(), JsonValue::parse(r#"{"k": [1]}"#).unwrap())],
        ..Default::default()
    };
    assert_eq!(render("{{ custom.k[0] }}", &[], &opts), "1");
}

#[test]
fn errors_name_the_template_and_the_line() {
    let e = ChatTemplate::new("line one\n{% if %}", "model.gguf: GGUF metadata `tokenizer.chat_template`", "", "")
        .unwrap_err();
    assert_eq!(e.line, Some(2));
    let s = e.to_string();
    assert!(s.contains("model.gguf: GGUF metadata `tokenizer.chat_template`") && s.contains("line 2"), "{s}");

    let t = ChatTemplate::new(
        "{% for m in messages %}\n{% if m.content == 'boom' %}\n{{ raise_exception('Conversation roles must alternate') }}\n{% endif %}{% endfor %}",
        "tpl.jinja",
        "",
        "",
    )
    .unwrap();
    let e = t.render(&[Message::user("boom")], &RenderOptions::default()).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("tpl.jinja") && s.contains("line 3") && s.contains("Conversation roles must alternate"), "{s}");
    // A template that refuses the system role gets it merged into the next message instead
    // (as llama.cpp does).
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}",
        "t",
        "",
        "",
    )
    .unwrap();
    assert_eq!(t.render(&[Message::system("s"), Message::user("u")], &RenderOptions::default()).unwrap(), "s\nu");

    let e = ChatTemplate::new("{{ 'a'.nosuchmethod() }}", "x.jinja", "", "")
        .unwrap()
        .render(&[], &RenderOptions::default());
    assert!(e.unwrap_err().to_string().contains("x.jinja"));
}

#[test]
fn messages_reach_the_template_as_llama_server_passes_them() {
    let src = "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }}({{ c.function.arguments | tojson }}) {{ c.id }}]{% endfor %}{% endif %}{% if m.tool_call_id %}<{{ m.tool_call_id }}|{{ m.name }}>{% endif %};{% endfor %}";
    let msgs = Message::list_from_json(
        r#"[{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [true]}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"}]"#,
    )
    .unwrap();
    assert_eq!(msgs[0].content, Content::Parts(vec!["a".into(), "b".into()]));
    assert_eq!(
        msgs[1].tool_calls[0],
        ToolCall { id: Some("c1".into()), name: "f".into(), arguments: "{\"z\": 1, \"a\": [true]}".into() }
    );
    let t = ChatTemplate::new(src, "t", "", "").unwrap();
    // Parts joined by a newline for a template that prints content as a string; arguments
    // handed over as an object, since the template reads them.
    assert!(!t.caps().typed_content && t.caps().object_arguments && t.caps().system_role);
    assert_eq!(
        t.render(&msgs, &RenderOptions::default()).unwrap(),
        "system:a\nb;assistant:[f({\"z\": 1, \"a\": [true]}) c1];tool:42<c1|f>;"
    );
    // Object arguments in the JSON keep their order.
    let m = Message::list_from_json(
        r#"[{"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": {"y": 1, "b": "x"}}}]}]"#,
    )
    .unwrap();
    assert_eq!(m[0].tool_calls[0].arguments, r#"{"y":1,"b":"x"}"#);

    // A template that iterates content parts gets the parts, and strings become one part.
    let typed = ChatTemplate::new(
        "{% for m in messages %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}",
        "t",
        "",
        "",
    )
    .unwrap();
    assert!(typed.caps().typed_content && !typed.caps().string_content);
    let msgs =
        [Message::user("s"), Message { content: Content::Parts(vec!["p".into(), "q".into()]), ..Message::user("") }];
    assert_eq!(typed.render(&msgs, &RenderOptions::default()).unwrap(), "s|p|q|");

    // A template that ignores the system role gets the system text in front of the next message.
    let no_system = ChatTemplate::new(
        "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}",
        "t",
        "",
        "",
    )
    .unwrap();
    assert!(!no_system.caps().system_role);
    assert_eq!(
        no_system.render(&[Message::system("S"), Message::user("U")], &RenderOptions::default()).unwrap(),
        "user:S\nU;"
    );
}

#[test]
fn chatml_is_llama_cpps_fallback() {
    let t = ChatTemplate::chatml("", "");
    assert_eq!(t.source(), CHATML);
    assert_eq!(
        t.render(&[Message::system("S"), Message::user("U")], &RenderOptions::default()).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.end_of_turn_texts(), vec!["<|im_end|>"]);
}

fn scratch(name: &str) -> PathBuf {
    let d = sluice_formats::scratch_root().join(format!("sluice-chat-template-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn hugging_face_directories_name_their_template() {
    let d = scratch("hf");
    assert!(ChatTemplate::from_hf_dir(&d).unwrap().is_none());
    // tokenizer_config.json: a string, BOS and EOS as added-token objects or strings.
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<B>", "lstrip": false}, "eos_token": "<E>", "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_hf_dir(&d).unwrap().unwrap();
    assert_eq!(t.render(&[Message::user("x")], &RenderOptions::default()).unwrap(), "<B>x<E>");
    assert!(t.origin().contains("tokenizer_config.json"));
    // A list of named templates: "default", and "tool_use" when tools are given.
    std::fs::write(
        d.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "T{{ tools | length }}"}, {"name": "default", "template": "D"}]}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_hf_dir(&d).unwrap().unwrap();
    assert_eq!(t.render(&[], &RenderOptions::default()).unwrap(), "D");
    assert_eq!(t.render(&[], &RenderOptions { tools: Some(tools_json()), ..Default::default() }).unwrap(), "T1");
    std::fs::write(d.join("tokenizer_config.json"), r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#)
        .unwrap();
    let e = ChatTemplate::from_hf_dir(&d).unwrap_err().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("\"default\""), "{e}");
    // chat_template.jinja wins over tokenizer_config.json; its errors name it.
    std::fs::write(d.join("chat_template.jinja"), "J{{ messages | length }}\n").unwrap();
    assert_eq!(ChatTemplate::from_hf_dir(&d).unwrap().unwrap().render(&[], &RenderOptions::default()).unwrap(), "J0");
    std::fs::write(d.join("chat_template.jinja"), "ok\n{% for %}").unwrap();
    let e = ChatTemplate::from_hf_dir(&d).unwrap_err();
    assert!(e.origin.ends_with("chat_template.jinja") && e.line == Some(2), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn tool_calls_are_read_back_out_of_generated_text() {
    let (rest, calls) = parse_tool_calls(
        "I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>{\"name\":\"get_time\",\"arguments\":{\"zone\":\"Asia/Tokyo\"}}</tool_call>",
    );
    assert_eq!(rest, "I'll check both.");
    assert_eq!(
        calls,
        vec![
            ToolCall { id: None, name: "get_weather".into(), arguments: r#"{"city":"Paris","unit":"celsius"}"#.into() },
            ToolCall { id: None, name: "get_time".into(), arguments: r#"{"zone":"Asia/Tokyo"}"#.into() },
        ]
    );
    // Arguments given as a JSON string stay that string; no arguments are an empty object.
    let (_, calls) = parse_tool_calls("<tool_call> {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"} </tool_call><tool_call>{\"name\": \"g\"}</tool_call>");
    assert_eq!(calls[0].arguments, "{\"a\": 1}");
    assert_eq!(calls[1].arguments, "{}");
    // Cut off before the closing tag (generation stopped there).
    let (rest, calls) = parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n");
    assert_eq!((rest.as_str(), calls.len()), ("", 1));
    // Not a call: broken JSON or no name stays in the text, as does text without calls.
    let text = "a <tool_call>{not json}</tool_call> b <tool_call>{\"arguments\": {}}</tool_call>";
    assert_eq!(parse_tool_calls(text), (text.to_string(), vec![]));
    assert_eq!(parse_tool_calls("  plain  "), ("  plain  ".to_string(), vec![]));
}

/// The prompts llama-server rendered with the real models' templates (their text is recorded
/// with them): the same text here, for every recorded conversation.
#[test]
fn real_templates_render_llama_servers_prompts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/chat");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        // Parsed keeping the order of object keys, as the tools' JSON is written in it.
        let rec = JsonValue::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let text = |v: &JsonValue, k: &str| v.get(k).unwrap().as_str().unwrap().to_string();
        let (bos, eos) = (text(&rec, "bos_token"), text(&rec, "eos_token"));
        let t = match text(&rec, "template").as_str() {
            "chatml-fallback" => ChatTemplate::chatml(&bos, &eos),
            _ => ChatTemplate::new(&text(&rec, "chat_template"), &path.display().to_string(), &bos, &eos).unwrap(),
        };
        let convs = rec.get("conversations").unwrap();
        for i in 0..convs.len() {
            let c = convs.at(i).unwrap();
            let msgs = Message::list_from_value(&c.get("messages").unwrap()).unwrap();
            let opts = RenderOptions {
                add_generation_prompt: c.get("add_generation_prompt").unwrap().as_bool().unwrap(),
                tools: c.get("tools"),
                ..Default::default()
            };
            let got = t.render(&msgs, &opts).unwrap();
            assert_eq!(got, text(&c, "prompt"), "{}: {}", path.display(), text(&c, "name"));
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} recorded conversations found in {}", dir.display());
}

#[test]
fn bare_call_objects_count_only_for_offered_tools() {
    let tools = JsonValue::parse(
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}, {"name": "get_time"}]"#,
    )
    .unwrap();
    let offered = tool_names(&tools);
    assert_eq!(offered, ["get_weather", "get_time"]);
    // What Qwen2.5-Coder-0.5B writes for a weather question: the call without its tags.
    let (rest, calls) =
        parse_tool_calls_offered(" {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", &offered);
    assert_eq!(rest, "");
    assert_eq!(calls, vec![ToolCall { id: None, name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }]);
    // Two calls, then text that is not a call (an invented tool result) stays text.
    let text = "{\"name\": \"get_time\"}\n{\"name\": \"get_weather\", \"arguments\": \"{}\"}\n{\"temp_c\": 2} done";
    let (rest, calls) = parse_tool_calls_offered(text, &offered);
    assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["get_time", "get_weather"]);
    assert_eq!(calls[0].arguments, "{}");
    assert_eq!(rest, "{\"temp_c\": 2} done");
    // A tool not offered, JSON that is data, text before the object, or no tools: no call.
    for t in [
        "{\"name\": \"rm_rf\", \"arguments\": {}}",
        "{\"city\": \"Paris\"}",
        "Sure: {\"name\": \"get_time\"}",
        "{\"name\": \"get_time\"",
    ] {
        assert_eq!(parse_tool_calls_offered(t, &offered), (t.to_string(), vec![]), "{t}");
    }
    assert_eq!(parse_tool_calls_offered("{\"name\": \"get_time\"}", &[]).1, vec![]);
    // The tagged format still wins, and is read whatever the names.
    let (_, calls) = parse_tool_calls_offered("<tool_call>{\"name\": \"other\"}</tool_call>", &offered);
    assert_eq!(calls[0].name, "other");
}
