// The engine panel: figures and a square per KV block from the WebSocket's
// `stats` messages (the engine's one EngineStats snapshot, docs/websocket.md).
"use strict";

const MAX_GRID_CELLS = 768;       // more blocks than this: one square stands for several

export class EnginePanel {
  /** `el`: the panel's elements ({engine, grid, gridScale, stat: {...}}). */
  constructor(el) {
    this.el = el;
    this.cells = [];
    this.scale = 1;
  }

  setLive(live) {
    this.el.engine.dataset.live = String(live);
  }

  buildGrid(numBlocks) {
    this.scale = Math.max(1, Math.ceil(numBlocks / MAX_GRID_CELLS));
    const numCells = Math.ceil(numBlocks / this.scale);
    const frag = document.createDocumentFragment();
    this.cells = [];
    for (let i = 0; i < numCells; i++) {
      const cell = document.createElement("i");
      cell.className = "b0";
      frag.appendChild(cell);
      this.cells.push(cell);
    }
    this.el.grid.replaceChildren(frag);
    this.el.grid.dataset.blocks = String(numBlocks);
    this.el.gridScale.textContent = this.scale > 1 ? `1 square = ${this.scale} blocks` : "";
  }

  renderGrid(map) {
    if (this.cells.length === 0 || Number(this.el.grid.dataset.blocks) !== map.length) {
      this.buildGrid(map.length);
    }
    for (let c = 0; c < this.cells.length; c++) {
      // A square standing for several blocks shows the busiest of them.
      let v = 0;
      const end = Math.min(map.length, (c + 1) * this.scale);
      for (let b = c * this.scale; b < end && v < 3; b++) v = Math.max(v, map[b]);
      const cls = `b${v}`;
      if (this.cells[c].className !== cls) this.cells[c].className = cls;
    }
  }

  render(s) {
    const stat = this.el.stat;
    this.setLive(true);
    stat.running.textContent = s.num_running;
    stat.waiting.textContent = s.num_waiting;
    stat.used.textContent = s.num_kv_blocks_used;
    stat.total.textContent = s.num_kv_blocks_total;
    stat.hitRate.textContent = s.prefix_cache_queries > 0
      ? `${(100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1)} %`
      : "–";
    stat.hitRate.title = `${s.prefix_cache_hits} of ${s.prefix_cache_queries} prompt tokens`;
    stat.preemptions.textContent = s.num_preemptions;
    stat.lastStep.textContent = `${s.num_reqs_last_step} req · ${s.num_tokens_last_step} tok`;
    // Speculative decoding: acceptance rate and tokens per verification ("–" while off).
    if (stat.spec) {
      stat.spec.textContent = s.spec_decode_num_drafts > 0
        ? `${(100 * s.spec_decode_acceptance_rate).toFixed(0)} % · ` +
          `${s.spec_decode_mean_acceptance_length.toFixed(2)} tok/step`
        : "–";
      stat.spec.title = `${s.spec_decode_num_accepted_tokens} of ` +
        `${s.spec_decode_num_draft_tokens} draft tokens accepted in ` +
        `${s.spec_decode_num_drafts} verifications`;
    }
    if (Array.isArray(s.block_usage_map) && s.block_usage_map.length) {
      this.renderGrid(s.block_usage_map);
    }
  }
}
