package dev.genserve.client;

import dev.genserve.v1.BatchResult;
import dev.genserve.v1.Completion;
import dev.genserve.v1.FinishReason;
import dev.genserve.v1.GenerateBatchRequest;
import dev.genserve.v1.GenerateBatchResponse;
import dev.genserve.v1.GenerateRequest;
import dev.genserve.v1.GenerateResponse;
import dev.genserve.v1.GenerateStreamRequest;
import dev.genserve.v1.GenerateStreamResponse;
import dev.genserve.v1.GenerationServiceGrpc;
import dev.genserve.v1.SamplingParameters;
import dev.genserve.v1.StoppingCriteria;
import io.grpc.ManagedChannel;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import io.grpc.netty.NettyChannelBuilder;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * Calls a genserve server: the gRPC health check, Generate, GenerateBatch and
 * GenerateStream, each under its own deadline.
 *
 * <p>The channel uses the {@code round_robin} load-balancing policy, so a {@code dns:///}
 * target that resolves to several addresses (a headless Kubernetes Service) spreads calls
 * per request across every replica instead of pinning them all to the first one, and
 * GenerationService calls answered {@code UNAVAILABLE} (nothing ran: a replica draining or
 * not ready) are retried, on the next replica first.
 *
 * <pre>
 * genserve-client --target dns:///genserve.default.svc.cluster.local:50051 health
 * genserve-client --max-new-tokens 16 generate "The capital of France is"
 * genserve-client batch "1, 2, 3," "a, b, c,"
 * genserve-client stream "Once upon a time"
 * </pre>
 */
public final class GenserveClient {
  private static final String USAGE = String.join("\n",
      "usage: genserve-client [flags] COMMAND [ARGS]",
      "",
      "commands:",
      "  health              grpc.health.v1 Check; exits 0 only when SERVING",
      "  generate PROMPT...  one Generate call per prompt",
      "  batch PROMPT...     one GenerateBatch call, one item per prompt (errors per item)",
      "  stream PROMPT       GenerateStream, printing every chunk as it arrives",
      "",
      "flags:",
      "  --target T          server target: host:port, dns:///name:port (all addresses,",
      "                      round_robin), ... (default dns:///localhost:50051)",
      "  --timeout D         deadline of each call: 30s, 500ms, 2m or seconds (default 60s)",
      "  --max-new-tokens N  stopping.max_new_tokens (default 32)",
      "  --temperature F     sampling.temperature (0 = greedy, the default)",
      "  --top-p F           sampling.top_p (0 = leave unset)",
      "  --max-attempts N    attempts per call answered UNAVAILABLE (1 = no retries, at",
      "                      most 5; default 5)");

  private final GenerationServiceGrpc.GenerationServiceBlockingStub generation;
  private final HealthGrpc.HealthBlockingStub health;
  private final long timeoutMs;
  private final int maxNewTokens;
  private final float temperature;
  private final float topP;

  private GenserveClient(ManagedChannel channel, long timeoutMs, int maxNewTokens,
      float temperature, float topP) {
    this.generation = GenerationServiceGrpc.newBlockingStub(channel);
    this.health = HealthGrpc.newBlockingStub(channel);
    this.timeoutMs = timeoutMs;
    this.maxNewTokens = maxNewTokens;
    this.temperature = temperature;
    this.topP = topP;
  }

  public static void main(String[] argv) throws InterruptedException {
    // Completions are Unicode: print UTF-8 whatever the locale says.
    System.setOut(new PrintStream(new FileOutputStream(FileDescriptor.out), true,
        StandardCharsets.UTF_8));
    System.setErr(new PrintStream(new FileOutputStream(FileDescriptor.err), true,
        StandardCharsets.UTF_8));
    String target = "dns:///localhost:50051";
    long timeoutMs = 60_000;
    int maxNewTokens = 32;
    float temperature = 0;
    float topP = 0;
    int maxAttempts = 5;
    List<String> args = new ArrayList<>();
    try {
      int i = 0;
      // Flags (-flag value or --flag value) come first, as with Go's flag package; the
      // first argument that is not a flag, or "--", ends them.
      for (; i < argv.length && argv[i].startsWith("-") && !argv[i].equals("-"); i++) {
        if (argv[i].equals("--")) {
          i++;
          break;
        }
        String flag = argv[i].startsWith("--") ? argv[i].substring(1) : argv[i];
        if (flag.equals("-h") || flag.equals("-help")) {
          System.out.println(USAGE);
          return;
        }
        if (i + 1 >= argv.length) {
          throw new IllegalArgumentException("flag needs a value: " + argv[i]);
        }
        String value = argv[i + 1];
        switch (flag) {
          case "-target": target = value; break;
          case "-timeout": timeoutMs = parseDurationMs(value); break;
          case "-max-new-tokens": maxNewTokens = Integer.parseUnsignedInt(value); break;
          case "-temperature": temperature = Float.parseFloat(value); break;
          case "-top-p": topP = Float.parseFloat(value); break;
          case "-max-attempts": maxAttempts = Integer.parseInt(value); break;
          default: throw new IllegalArgumentException("unknown flag: " + argv[i]);
        }
        i++;
      }
      args.addAll(List.of(argv).subList(i, argv.length));
    } catch (IllegalArgumentException e) {
      System.err.println("error: " + e.getMessage() + "\n" + USAGE);
      System.exit(2);
    }
    String command = args.isEmpty() ? "" : args.get(0);
    List<String> rest = args.isEmpty() ? args : args.subList(1, args.size());
    boolean ok = (command.equals("health") && rest.isEmpty())
        || ((command.equals("generate") || command.equals("batch")) && !rest.isEmpty())
        || (command.equals("stream") && rest.size() == 1);
    if (!ok || maxAttempts < 1 || maxAttempts > 5) {
      System.err.println(USAGE);
      System.exit(2);
    }

    ManagedChannel channel = NettyChannelBuilder.forTarget(target)
        .defaultServiceConfig(serviceConfig(maxAttempts))
        .enableRetry()
        .usePlaintext()
        .build();
    int exit = 0;
    try {
      GenserveClient client =
          new GenserveClient(channel, timeoutMs, maxNewTokens, temperature, topP);
      switch (command) {
        case "health": exit = client.checkHealth() ? 0 : 1; break;
        case "generate": client.generate(rest); break;
        case "batch": client.batch(rest); break;
        default: client.stream(rest.get(0)); break;
      }
    } catch (StatusRuntimeException e) {
      Status status = e.getStatus();
      System.err.println("error: " + describe(status.getCode(), status.getDescription(),
          timeoutMs));
      exit = 1;
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
    System.exit(exit);
  }

  /**
   * The channel's service config: round_robin (one subchannel per resolved address, calls
   * spread over the READY ones in turn) and, when maxAttempts > 1, a retry policy for
   * GenerationService calls answered UNAVAILABLE. A call that got a response header is
   * never retried: a stream is not repeated once it has started. (JSON numbers are
   * doubles here, as the parsed JSON would hold them.)
   */
  static Map<String, Object> serviceConfig(int maxAttempts) {
    Map<String, Object> config = new HashMap<>();
    config.put("loadBalancingConfig", List.of(Map.of("round_robin", Map.of())));
    if (maxAttempts > 1) {
      config.put("methodConfig", List.of(Map.of(
          "name", List.of(Map.of("service", "genserve.v1.GenerationService")),
          "retryPolicy", Map.of(
              "maxAttempts", (double) maxAttempts,
              "initialBackoff", "0.1s",
              "maxBackoff", "2s",
              "backoffMultiplier", 2.0,
              "retryableStatusCodes", List.of("UNAVAILABLE")))));
    }
    return config;
  }

  private GenerateRequest request(String prompt) {
    SamplingParameters.Builder sampling = SamplingParameters.newBuilder();
    if (temperature != 0) {
      sampling.setTemperature(temperature);
    }
    if (topP != 0) {
      sampling.setTopP(topP);
    }
    return GenerateRequest.newBuilder()
        .setPrompt(prompt)
        .setSampling(sampling)
        .setStopping(StoppingCriteria.newBuilder().setMaxNewTokens(maxNewTokens))
        .build();
  }

  private boolean checkHealth() {
    HealthCheckResponse resp = health.withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS)
        .check(HealthCheckRequest.getDefaultInstance());
    System.out.println("health: " + resp.getStatus());
    if (resp.getStatus() != HealthCheckResponse.ServingStatus.SERVING) {
      System.err.println("error: server is not SERVING");
      return false;
    }
    return true;
  }

  private void generate(List<String> prompts) {
    for (int i = 0; i < prompts.size(); i++) {
      // A deadline per call: withDeadlineAfter starts the clock now.
      GenerateResponse resp = generation.withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS)
          .generate(request(prompts.get(i)));
      System.out.printf("generate[%d] %s%n", i, completion(resp));
    }
  }

  private void batch(List<String> prompts) {
    GenerateBatchRequest.Builder batch = GenerateBatchRequest.newBuilder();
    for (String prompt : prompts) {
      batch.addRequests(request(prompt));
    }
    GenerateBatchResponse resp = generation.withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS)
        .generateBatch(batch.build());
    for (BatchResult result : resp.getResultsList()) {
      if (result.hasResponse()) {
        System.out.printf("batch[%d] ok %s%n", result.getIndex(),
            completion(result.getResponse()));
      } else {
        Status.Code code = Status.fromCodeValue(result.getError().getCode()).getCode();
        System.out.printf("batch[%d] error: %s%n", result.getIndex(),
            describe(code, result.getError().getMessage(), timeoutMs));
      }
    }
  }

  private void stream(String prompt) {
    // The deadline covers the whole stream.
    Iterator<GenerateStreamResponse> stream =
        generation.withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS)
            .generateStream(GenerateStreamRequest.newBuilder().setRequest(request(prompt)).build());
    StringBuilder text = new StringBuilder();
    FinishReason finish = FinishReason.FINISH_REASON_UNSPECIFIED;
    int tokens = 0;
    for (int chunk = 0; stream.hasNext(); chunk++) {
      GenerateStreamResponse msg = stream.next();
      System.out.printf("chunk[%d] %s%n", chunk, quote(msg.getText()));
      text.append(msg.getText());
      if (msg.getFinishReason() != FinishReason.FINISH_REASON_UNSPECIFIED) {
        finish = msg.getFinishReason();
      }
      if (msg.hasUsage()) {
        tokens = msg.getUsage().getCompletionTokens();
      }
    }
    System.out.printf("stream finish=%s completion_tokens=%d text=%s%n", finishName(finish),
        tokens, quote(text.toString()));
  }

  private static String completion(GenerateResponse resp) {
    if (resp.getCompletionsCount() == 0) {
      return "no completions";
    }
    Completion first = resp.getCompletions(0);
    return String.format("finish=%s completion_tokens=%d text=%s",
        finishName(first.getFinishReason()), resp.getUsage().getCompletionTokens(),
        quote(first.getText()));
  }

  private static String finishName(FinishReason reason) {
    return reason.name().replaceFirst("^FINISH_REASON_", "");
  }

  /** Turns a gRPC status into a message that says what to do about it. */
  static String describe(Status.Code code, String details, long timeoutMs) {
    String d = details == null ? "" : details;
    switch (code) {
      case INVALID_ARGUMENT: return "invalid request: " + d;
      case UNAVAILABLE:
        return "server unavailable (not running, still loading the model, or draining): " + d;
      case DEADLINE_EXCEEDED: return "deadline exceeded (" + timeoutMs + "ms): " + d;
      case RESOURCE_EXHAUSTED: return "server overloaded (waiting queue full), retry later: " + d;
      case CANCELLED: return "call cancelled: " + d;
      case INTERNAL: return "server error: " + d;
      case UNIMPLEMENTED: return "not supported by this server: " + d;
      default: return code + ": " + d;
    }
  }

  /** "30s", "500ms", "2m" or plain seconds, in milliseconds. */
  static long parseDurationMs(String text) {
    try {
      if (text.endsWith("ms")) {
        return Long.parseLong(text.substring(0, text.length() - 2));
      }
      if (text.endsWith("m")) {
        return Math.round(Double.parseDouble(text.substring(0, text.length() - 1)) * 60_000);
      }
      String seconds = text.endsWith("s") ? text.substring(0, text.length() - 1) : text;
      return Math.round(Double.parseDouble(seconds) * 1000);
    } catch (NumberFormatException e) {
      throw new IllegalArgumentException("not a duration: " + text);
    }
  }

  /** s as a JSON string: one line, exact, easy to read back. */
  static String quote(String s) {
    StringBuilder out = new StringBuilder(s.length() + 2).append('"');
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      switch (c) {
        case '"': out.append("\\\""); break;
        case '\\': out.append("\\\\"); break;
        case '\n': out.append("\\n"); break;
        case '\r': out.append("\\r"); break;
        case '\t': out.append("\\t"); break;
        default:
          if (c < 0x20) {
            out.append(String.format("\\u%04x", (int) c));
          } else {
            out.append(c);
          }
      }
    }
    return out.append('"').toString();
  }
}
