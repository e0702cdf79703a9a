//! `stop` strings: the answer ends before the first of them, and no part of one is ever sent.
//! Text is released as it comes, except a tail that could still grow into a stop string, which
//! is held until the next token settles it (or the answer ends without one).

/// One sequence's stop strings and the text held back.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What a new piece of text gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text to send now.
    pub text: String,
    /// A stop string was reached: nothing more is sent.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        let found = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = found {
            let text = self.held[..at].to_owned();
            self.held.clear();
            return Released { text, stopped: true };
        }
        // The longest tail that is the beginning of a stop string stays held.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let text = self.held[..keep].to_owned();
        self.held.drain(..keep);
        Released { text, stopped: false }
    }

    /// Text of the answer's first `min_tokens` tokens: sent as it is, no stop string looked for
    /// in it (vLLM's rule; unlike vLLM, a stop string that begins there and ends later is not
    /// found either).
    pub fn pass(&mut self, piece: &str) -> Released {
        debug_assert!(self.held.is_empty(), "nothing is held before the stop strings are looked for");
        Released { text: piece.to_owned(), stopped: false }
    }

    /// The answer ended without a stop string: what was held is part of it.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p);
            out.push(r.text);
            if r.stopped {
                return (out, true, String::new());
            }
        }
        let rest = m.finish();
        (out, false, rest)
    }

    #[test]
    fn text_before_the_stop_is_sent_and_the_stop_never() {
        let (out, stopped, _) = run(&["END"], &["a", " b E", "N", "D c"]);
        assert_eq!(out, vec!["a", " b ", "", ""]);
        assert!(stopped);
    }

    #[test]
    fn a_tail_that_does_not_become_a_stop_is_released() {
        let (out, stopped, rest) = run(&["END"], &["a E", "x", " EN"]);
        assert_eq!(out, vec!["a ", "Ex", " "]);
        assert!(!stopped);
        assert_eq!(rest, "EN", "held at the end, then released");
    }

    #[test]
    fn the_earliest_of_several_stops_ends_it_and_characters_are_not_split() {
        let (out, stopped, _) = run(&["ü!", "b"], &["aü", "!b"]);
        assert_eq!(out, vec!["a", ""]);
        assert!(stopped);
        let (out, stopped, _) = run(&[], &["x", "y"]);
        assert_eq!((out, stopped), (vec!["x".to_owned(), "y".to_owned()], false));
    }
}
