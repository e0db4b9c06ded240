use crate::common::ModelArgs;
use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Text to tokenize.
    #[arg(long)]
    text: Option<String>,
    /// Read the text from this file instead.
    #[arg(long, conflicts_with = "text")]
    file: Option<std::path::PathBuf>,
    /// Leave out the BOS token even if the model adds one.
    #[arg(long)]
    no_bos: bool,
    /// Print `{"ids": [...]}`; otherwise one `id<TAB>piece` line per token.
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
        (None, None) => anyhow::bail!("give the text with --text TEXT or --file PATH"),
    };
    let engine = a.model.load_tokenizer_only()?;
    let tok = engine.tokenizer()?;
    let mut ids = tok.encode(&text, true).map_err(|e| anyhow::anyhow!(e))?;
    if a.no_bos {
        if let (Some(b), Some(first)) = (engine.bos(), ids.first()) {
            if *first == b {
                ids.remove(0);
            }
        }
    }
    if a.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in ids {
            println!("{id}\t{:?}", tok.decode(&[id], false));
        }
    }
    Ok(())
}
