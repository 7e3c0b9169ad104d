// Command genserve-client calls a genserve server: the gRPC health check, Generate,
// GenerateBatch and GenerateStream, each under its own deadline.
//
// The channel uses the round_robin load-balancing policy, so a dns:/// target that
// resolves to several addresses (a headless Kubernetes Service) spreads calls per request
// across every replica instead of pinning them all to the first one, and retries
// GenerationService calls answered UNAVAILABLE (nothing ran: a replica draining or not
// ready), on the next replica first.
//
//	genserve-client -target dns:///genserve.default.svc.cluster.local:50051 health
//	genserve-client -max-new-tokens 16 generate "The capital of France is"
//	genserve-client batch "1, 2, 3," "a, b, c,"
//	genserve-client stream "Once upon a time"
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// serviceConfig is the channel's default service config: round_robin (one subchannel per
// resolved address, calls spread over the READY ones in turn) and, when maxAttempts > 1,
// a retry policy for GenerationService calls answered UNAVAILABLE. A call that got a
// response header is never retried: a stream is not repeated once it has started.
func serviceConfig(maxAttempts uint) string {
	config := `{"loadBalancingConfig": [{"round_robin": {}}]`
	if maxAttempts > 1 {
		config += fmt.Sprintf(`, "methodConfig": [{
		"name": [{"service": "genserve.v1.GenerationService"}],
		"retryPolicy": {"maxAttempts": %d, "initialBackoff": "0.1s", "maxBackoff": "2s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]`, maxAttempts)
	}
	return config + "}"
}

const usage = `usage: genserve-client [flags] COMMAND [ARGS]

commands:
  health              grpc.health.v1 Check; exits 0 only when SERVING
  generate PROMPT...  one Generate call per prompt
  batch PROMPT...     one GenerateBatch call, one item per prompt (errors per item)
  stream PROMPT       GenerateStream, printing every chunk as it arrives

flags:
`

type client struct {
	gen     genservev1.GenerationServiceClient
	health  healthpb.HealthClient
	timeout time.Duration
	params  func() *genservev1.GenerateRequest
}

func main() {
	target := flag.String("target", "dns:///localhost:50051",
		"server target: host:port, dns:///name:port (all addresses, round_robin), ...")
	timeout := flag.Duration("timeout", 60*time.Second, "deadline of each call")
	maxNewTokens := flag.Uint("max-new-tokens", 32, "stopping.max_new_tokens")
	temperature := flag.Float64("temperature", 0, "sampling.temperature (0 = greedy)")
	topP := flag.Float64("top-p", 0, "sampling.top_p (0 = leave unset)")
	maxAttempts := flag.Uint("max-attempts", 5,
		"attempts per call answered UNAVAILABLE (1 = no retries, at most 5)")
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), usage)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 || *maxAttempts < 1 || *maxAttempts > 5 {
		flag.Usage()
		os.Exit(2)
	}

	conn, err := grpc.NewClient(*target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(serviceConfig(*maxAttempts)))
	if err != nil {
		fmt.Fprintf(os.Stderr, "error: bad target %q: %v\n", *target, err)
		os.Exit(2)
	}
	defer conn.Close()

	c := &client{
		gen:     genservev1.NewGenerationServiceClient(conn),
		health:  healthpb.NewHealthClient(conn),
		timeout: *timeout,
		params: func() *genservev1.GenerateRequest {
			req := &genservev1.GenerateRequest{
				Sampling: &genservev1.SamplingParameters{},
				Stopping: &genservev1.StoppingCriteria{MaxNewTokens: ptr(uint32(*maxNewTokens))},
			}
			if *temperature != 0 {
				req.Sampling.Temperature = ptr(float32(*temperature))
			}
			if *topP != 0 {
				req.Sampling.TopP = ptr(float32(*topP))
			}
			return req
		},
	}

	command, args := flag.Arg(0), flag.Args()[1:]
	switch {
	case command == "health" && len(args) == 0:
		err = c.checkHealth()
	case command == "generate" && len(args) > 0:
		err = c.generate(args)
	case command == "batch" && len(args) > 0:
		err = c.batch(args)
	case command == "stream" && len(args) == 1:
		err = c.stream(args[0])
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", describe(err, *timeout))
		os.Exit(1)
	}
}

func (c *client) checkHealth() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return err
	}
	fmt.Println("health:", resp.GetStatus())
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return errors.New("server is not SERVING")
	}
	return nil
}

func (c *client) generate(prompts []string) error {
	for i, prompt := range prompts {
		req := c.params()
		req.Input = &genservev1.GenerateRequest_Prompt{Prompt: prompt}
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		resp, err := c.gen.Generate(ctx, req)
		cancel()
		if err != nil {
			return err
		}
		fmt.Printf("generate[%d] %s\n", i, completion(resp))
	}
	return nil
}

func (c *client) batch(prompts []string) error {
	batch := &genservev1.GenerateBatchRequest{}
	for _, prompt := range prompts {
		req := c.params()
		req.Input = &genservev1.GenerateRequest_Prompt{Prompt: prompt}
		batch.Requests = append(batch.Requests, req)
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	resp, err := c.gen.GenerateBatch(ctx, batch)
	if err != nil {
		return err
	}
	for _, result := range resp.GetResults() {
		switch outcome := result.GetOutcome().(type) {
		case *genservev1.BatchResult_Response:
			fmt.Printf("batch[%d] ok %s\n", result.GetIndex(), completion(outcome.Response))
		case *genservev1.BatchResult_Error:
			fmt.Printf("batch[%d] error: %s\n", result.GetIndex(), describeCode(
				codes.Code(outcome.Error.GetCode()), outcome.Error.GetMessage(), c.timeout))
		}
	}
	return nil
}

func (c *client) stream(prompt string) error {
	req := c.params()
	req.Input = &genservev1.GenerateRequest_Prompt{Prompt: prompt}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout) // the whole stream
	defer cancel()
	stream, err := c.gen.GenerateStream(ctx, &genservev1.GenerateStreamRequest{Request: req})
	if err != nil {
		return err
	}
	var text strings.Builder
	finish, tokens := genservev1.FinishReason_FINISH_REASON_UNSPECIFIED, uint32(0)
	for chunk := 0; ; chunk++ {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		fmt.Printf("chunk[%d] %s\n", chunk, quote(msg.GetText()))
		text.WriteString(msg.GetText())
		if msg.GetFinishReason() != genservev1.FinishReason_FINISH_REASON_UNSPECIFIED {
			finish = msg.GetFinishReason()
		}
		if msg.GetUsage() != nil {
			tokens = msg.GetUsage().GetCompletionTokens()
		}
	}
	fmt.Printf("stream finish=%s completion_tokens=%d text=%s\n",
		finishName(finish), tokens, quote(text.String()))
	return nil
}

func completion(resp *genservev1.GenerateResponse) string {
	if len(resp.GetCompletions()) == 0 {
		return "no completions"
	}
	first := resp.GetCompletions()[0]
	return fmt.Sprintf("finish=%s completion_tokens=%d text=%s", finishName(first.GetFinishReason()),
		resp.GetUsage().GetCompletionTokens(), quote(first.GetText()))
}

func finishName(reason genservev1.FinishReason) string {
	return strings.TrimPrefix(reason.String(), "FINISH_REASON_")
}

// describe turns an RPC error into a message that says what to do about it.
func describe(err error, timeout time.Duration) string {
	if st, ok := status.FromError(err); ok {
		return describeCode(st.Code(), st.Message(), timeout)
	}
	return err.Error()
}

func describeCode(code codes.Code, details string, timeout time.Duration) string {
	switch code {
	case codes.InvalidArgument:
		return "invalid request: " + details
	case codes.Unavailable:
		return "server unavailable (not running, still loading the model, or draining): " + details
	case codes.DeadlineExceeded:
		return fmt.Sprintf("deadline exceeded (%s): %s", timeout, details)
	case codes.ResourceExhausted:
		return "server overloaded (waiting queue full), retry later: " + details
	case codes.Canceled:
		return "call cancelled: " + details
	case codes.Internal:
		return "server error: " + details
	case codes.Unimplemented:
		return "not supported by this server: " + details
	default:
		return fmt.Sprintf("%s: %s", code, details)
	}
}

// quote writes s as a JSON string: one line, exact, easy to read back.
func quote(s string) string {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s)
	return strings.TrimSuffix(buf.String(), "\n")
}

func ptr[T any](v T) *T { return &v }
