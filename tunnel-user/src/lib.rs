pub mod intercept;
