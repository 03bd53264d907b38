// The names written on the timeline's bars, drawn as one SVG layer over the plot.
//
// figures.py puts them in the figure's layout.meta.labels ({x, y, text, beside}: the left end
// of the visible part of a bar plus padding, or of the room right of a narrow bar, in data
// coordinates, its row, its name cut to fit, and whether it is beside its bar). As
// a plotly text trace they cost plotly a third of its drawing time (each text element styled one
// by one); here they are plain <text> nodes styled once by their layer. Names are set as
// textContent, never parsed: a span named like a script tag shows those characters.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function draw(gd, xrange) {
    var fl = gd._fullLayout;
    var labels = fl && fl.meta && fl.meta.labels;
    var layer = gd.querySelector("svg.gpu-trace-labels");
    var xa = fl && fl.xaxis;
    var ya = fl && fl.yaxis;
    if (!labels || !xa || !ya || !xa._length || !ya._length) {
      if (layer) layer.remove();
      return;
    }
    var xr = xrange || xa.range;
    var yr = ya.range;
    var w = xa._length;
    var h = ya._length;
    var key = [xr[0], xr[1], yr[0], yr[1], w, h, xa._offset, ya._offset].join(",");
    if (layer && layer._labels === labels && layer._key === key) return;
    if (!layer) {
      var main = gd.querySelector(".main-svg");
      if (!main) return;
      layer = document.createElementNS(SVG, "svg");
      layer.setAttribute("class", "gpu-trace-labels");
      // Above the bars, under plotly's hover labels and zoom box; clicks and hovers go through.
      layer.style.cssText = "position:absolute;pointer-events:none;overflow:hidden;" +
        "font-family:'Open Sans',verdana,arial,sans-serif;font-size:10px;fill:#fff;" +
        "dominant-baseline:central;white-space:pre";
      main.parentNode.insertBefore(layer, main.nextSibling);
    }
    layer.style.left = xa._offset + "px";
    layer.style.top = ya._offset + "px";
    layer.setAttribute("width", w);
    layer.setAttribute("height", h);
    var sx = w / (xr[1] - xr[0]);
    var sy = h / (yr[1] - yr[0]);
    var xs = labels.x;
    var ys = labels.y;
    var texts = labels.text;
    var beside = labels.beside || [];
    var frag = document.createDocumentFragment();
    for (var i = 0; i < texts.length; i++) {
      var x = (xs[i] - xr[0]) * sx;
      var y = (yr[1] - ys[i]) * sy; // SVG's y grows downwards, plotly's upwards
      if (x >= w || y < 0 || y > h) continue;
      var t = document.createElementNS(SVG, "text");
      t.setAttribute("x", x.toFixed(1));
      t.setAttribute("y", y.toFixed(1));
      if (beside[i]) {
        // Beside its narrow bar: dark on a white halo, readable over density too.
        t.setAttribute("class", "beside");
        t.setAttribute("fill", "#222");
        t.setAttribute("stroke", "#fff");
        t.setAttribute("stroke-width", "3");
        t.setAttribute("stroke-linejoin", "round");
        t.setAttribute("paint-order", "stroke");
      }
      t.textContent = texts[i];
      frag.appendChild(t);
    }
    layer.replaceChildren(frag);
    layer._labels = labels;
    layer._key = key;
  }

  function hook(gd) {
    if (!gd || !gd.on || !gd._ev) return gd;
    // Plotly calls listeners on its event emitter, not on gd: each gd gets its own.
    var on = gd._gpuTraceLabels;
    if (!on) {
      on = gd._gpuTraceLabels = {
        afterplot: function () {
          draw(gd);
        },
        relayouting: function (ev) {
          // While a pan or a scroll zoom is dragged, plotly moves the bars without a redraw.
          var r = ev && ev["xaxis.range"];
          var a = ev && ev["xaxis.range[0]"];
          var b = ev && ev["xaxis.range[1]"];
          if (r) draw(gd, r);
          else if (a !== undefined && b !== undefined) draw(gd, [a, b]);
        },
      };
    }
    // dcc.Graph removes every listener of a graph it lets go of: hook again if they are gone.
    if (gd._ev.listeners("plotly_afterplot").indexOf(on.afterplot) < 0) {
      gd.on("plotly_afterplot", on.afterplot);
      gd.on("plotly_relayouting", on.relayouting);
    }
    draw(gd);
    return gd;
  }

  ["newPlot", "react"].forEach(function (name) {
    var plot = window.Plotly && window.Plotly[name];
    if (!plot) return;
    window.Plotly[name] = function () {
      return plot.apply(this, arguments).then(hook);
    };
  });
  window.gpuTraceLabels = { draw: draw };
})();
