//! A model's chat template, compiled once when the model loads (rendering is then all a request
//! pays), and the controls vLLM gives a request over it: `add_generation_prompt`,
//! `continue_final_message` and `chat_template_kwargs`, with the request's `tools` and each
//! message's tool calls, tool call id and name, as transformers passes them.
//!
//! Templates are Jinja written for transformers, rendered with `minijinja` with Python's string
//! methods. `continue_final_message` is rendered as transformers does it: without the generation
//! prompt, cut right after the final message's text, so that the model goes on with it.

use serde_json::{Map, Value as Json};

use crate::text::Message;

/// How a conversation is rendered.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// End with the opening of the assistant's turn (the default).
    pub add_generation_prompt: bool,
    /// Leave the final message open, with no end of turn after it, for the model to continue.
    pub continue_final_message: bool,
    /// More variables for the template (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`).
    pub kwargs: Map<String, Json>,
    /// The tools the model may call, as OpenAI's `tools` lists them (the template's `tools`).
    pub tools: Option<Vec<Json>>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions { add_generation_prompt: true, continue_final_message: false, kwargs: Map::new(), tools: None }
    }
}

/// The variables the renderer sets itself, which `chat_template_kwargs` may not replace.
pub const RESERVED: [&str; 5] = ["messages", "add_generation_prompt", "bos_token", "eos_token", "tools"];

/// A chat template, compiled.
pub struct Template {
    env: minijinja::Environment<'static>,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template").finish_non_exhaustive()
    }
}

impl Template {
    /// Compiles `source`; the message says where it does not parse.
    pub fn new(source: String) -> Result<Template, String> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned("chat", source).map_err(|e| format!("the model's chat template does not parse: {e}"))?;
        Ok(Template { env })
    }

    /// The prompt of a conversation; `bos` and `eos` are the model's tokens' text.
    pub fn render(&self, messages: &[Message], options: &ChatOptions, bos: &str, eos: &str) -> Result<String, String> {
        if options.add_generation_prompt && options.continue_final_message {
            return Err("'add_generation_prompt' and 'continue_final_message' cannot both be true".into());
        }
        if let Some(key) = options.kwargs.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(format!("'chat_template_kwargs' sets '{key}', which the server sets itself"));
        }
        let last = messages.last().map(|m| m.content.trim()).unwrap_or_default();
        if options.continue_final_message && last.is_empty() {
            return Err("'continue_final_message' needs a final message with text to continue".into());
        }
        let mut context: Map<String, Json> = options.kwargs.clone();
        context.insert(
            "messages".into(),
            messages
                .iter()
                .map(|m| {
                    let mut message = m.extra.clone();
                    message.insert("role".into(), Json::from(m.role.as_str()));
                    message.insert("content".into(), Json::from(m.content.as_str()));
                    Json::Object(message)
                })
                .collect(),
        );
        if let Some(tools) = &options.tools {
            context.insert("tools".into(), Json::Array(tools.clone()));
        }
        context.insert("add_generation_prompt".into(), Json::Bool(options.add_generation_prompt));
        context.insert("bos_token".into(), Json::from(bos));
        context.insert("eos_token".into(), Json::from(eos));
        let mut rendered = self
            .env
            .get_template("chat")
            .and_then(|t| t.render(minijinja::Value::from_serialize(&context)))
            .map_err(|e| format!("the model's chat template refuses these messages: {e}"))?;
        if options.continue_final_message {
            let end = rendered.rfind(last).ok_or(
                "'continue_final_message': the model's chat template changes the final message's text, so where \
                 it ends cannot be found",
            )? + last.len();
            rendered.truncate(end);
        }
        Ok(rendered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}\
        <think></think>{% endif %}{% endif %}";

    fn said(turns: &[(&str, &str)]) -> Vec<Message> {
        turns.iter().map(|(role, content)| Message::new(*role, *content)).collect()
    }

    #[test]
    fn the_controls_render_as_transformers_renders_them() {
        let t = Template::new(CHATML.into()).expect("parses");
        let chat = said(&[("user", "Capital of France?"), ("assistant", "The capital is ")]);
        let render = |o: &ChatOptions| t.render(&chat, o, "", "");
        let whole =
            "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nThe capital is <|im_end|>\n";
        assert_eq!(render(&ChatOptions::default()).unwrap(), format!("{whole}<|im_start|>assistant\n"));
        let closed = ChatOptions { add_generation_prompt: false, ..ChatOptions::default() };
        assert_eq!(render(&closed).unwrap(), whole);
        // Continued: cut after the final message's text (trimmed, as transformers does).
        let open = ChatOptions { continue_final_message: true, ..closed.clone() };
        assert_eq!(render(&open).unwrap(), whole.trim_end_matches(" <|im_end|>\n"));
        let both = ChatOptions { continue_final_message: true, ..ChatOptions::default() };
        assert_eq!(
            render(&both).unwrap_err(),
            "'add_generation_prompt' and 'continue_final_message' cannot both be true"
        );
        // Variables for the template; the server's own cannot be replaced.
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Json::Bool(false));
        let thinking = ChatOptions { kwargs, ..ChatOptions::default() };
        assert!(render(&thinking).unwrap().ends_with("assistant\n<think></think>"));
        let mut kwargs = Map::new();
        kwargs.insert("messages".into(), Json::Array(vec![]));
        assert_eq!(
            render(&ChatOptions { kwargs, ..ChatOptions::default() }).unwrap_err(),
            "'chat_template_kwargs' sets 'messages', which the server sets itself"
        );
    }

    #[test]
    fn tools_and_a_messages_tool_calls_reach_the_template() {
        let t = Template::new(
            "{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:\
             {% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}\
             {{ m.tool_call_id or '' }}{{ m.content }};{% endfor %}"
                .into(),
        )
        .expect("parses");
        let mut call = Message::new("assistant", "");
        call.extra.insert(
            "tool_calls".into(),
            serde_json::json!([{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]),
        );
        let mut result = Message::new("tool", "sunny");
        result.extra.insert("tool_call_id".into(), Json::from("c1"));
        let tools = Some(vec![serde_json::json!({"type": "function", "function": {"name": "weather"}})]);
        let options = ChatOptions { tools, ..ChatOptions::default() };
        let rendered = t.render(&[Message::new("user", "hi"), call, result], &options, "", "").unwrap();
        assert_eq!(rendered, "[weather]user:hi;assistant:weather(Oslo);tool:c1sunny;");
        let mut kwargs = Map::new();
        kwargs.insert("tools".into(), Json::Array(vec![]));
        assert!(t
            .render(&[], &ChatOptions { kwargs, ..ChatOptions::default() }, "", "")
            .unwrap_err()
            .contains("'tools'"));
    }

    #[test]
    fn a_template_that_does_not_parse_says_so_once() {
        let e = Template::new("{% for m in messages %}".into()).unwrap_err();
        assert!(e.starts_with("the model's chat template does not parse"), "{e}");
        let t = Template::new(
            "{{ messages[0].content | upper }}{{ raise_exception('no') if messages | length > 1 }}".into(),
        )
        .expect("parses");
        assert_eq!(t.render(&said(&[("user", "hi")]), &ChatOptions::default(), "", "").unwrap(), "HI");
        let e = t.render(&said(&[("user", "a"), ("user", "b")]), &ChatOptions::default(), "", "").unwrap_err();
        assert!(e.contains("refuses these messages") && e.contains("no"), "{e}");
    }
}
