//! gpushare-extender's configuration file: any text is a configuration or an error naming the
//! line, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let path = std::path::Path::new("/etc/gpushare/gpushare-extender.toml");
    if let Err(e) = gpushare_extender::config::Config::parse(text, path) {
        assert!(!e.to_string().is_empty());
    }
});
